"""Line charts drawn with Pillow: the training curves (lenet/plot.py's Curves) and a sweep's figure.

Note [charts on Pillow]: the plotting child (Note [plotting in a child] in lenet/plot.py) drew with
matplotlib, whose import and first figure were a fast run's end where the child was slower than the run, and
whose first import made a font list that needed a folder of the trainer's until the checks passed. Pillow, which
lenet predict reads images with, imports in a few hundredths of a second and draws a whole figure of this kind,
PNG included, in about as long: nothing is kept between drawings and nothing but the file is written. The figure
is drawn at SCALE times its size and reduced (Lanczos), which smooths lines and text. The measurements:
docs/performance.md, "Notes' numbers: writing".
"""

from __future__ import annotations

import io
import math

from PIL import Image, ImageDraw, ImageFont

SCALE = 2
COLORS = {"C0": (31, 119, 180), "C1": (255, 127, 14), "C2": (44, 160, 44), "C3": (214, 39, 40),
          "gray": (160, 160, 160)}   # matplotlib's first four and a grey
GRID = (232, 232, 232)
INK = (34, 34, 34)
STEPS = (1.0, 2.0, 2.5, 5.0, 10.0)   # a tick step is one of these times a power of ten


def ticks(lo: float, hi: float, nbins: int = 5, integer: bool = False) -> list[float]:
    """The values of at most ``nbins`` + 1 evenly spaced ticks whose first is at or under ``lo`` and last at or
    over ``hi``, their step the smallest of STEPS times a power of ten that makes that few (whole numbers
    only with ``integer``). A range flat for its magnitude is widened around it by 5% (by 1 around 0), an
    integer range to a width of 1 at least; bounds past +-1e300 are taken as 1e300."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"ticks of a range that is not finite: {lo} .. {hi}")
    lo, hi = max(min(lo, hi), -1e300), min(max(lo, hi), 1e300)
    if hi - lo <= max(abs(lo), abs(hi)) * 1e-9 or hi - lo < 1e-200:
        pad = abs(lo) * 0.05 or 1.0
        lo, hi = lo - pad, hi + pad
    if integer and hi - lo < 1.0:
        mid = (lo + hi) / 2
        lo, hi = mid - 0.5, mid + 0.5
    power = 10.0 ** math.floor(math.log10((hi - lo) / nbins))
    for step in (s * power * m for m in (1.0, 10.0) for s in STEPS):
        if integer and (step < 1 or step != int(step)):
            continue
        first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
        if last - first <= nbins:
            return [float(f"{k * step:.12g}") for k in range(first, last + 1)]
    raise AssertionError("unreachable: the last step spans the range in one")


def label(value: float, step: float) -> str:
    """A tick's text, with the digits its step tells apart: fixed (0.25 two decimals, 0.5 one, 5 none), or
    with an exponent past six decimals or a million (a diverged run's losses, a flat curve's close ticks)."""
    step = abs(step) or 1.0
    decimals = max(0, -math.floor(math.log10(step)))
    while decimals < 20 and abs(step * 10 ** decimals - round(step * 10 ** decimals)) > 1e-6 * step * 10 ** decimals:
        decimals += 1
    if decimals <= 6 and abs(value) < 1e6:
        return f"{value:.{decimals}f}"
    if value == 0:
        return "0"
    digits = math.floor(math.log10(abs(value))) - math.floor(math.log10(step)) + 1
    return f"{value:.{max(digits, 1)}g}"


def _font(size: float):
    """Pillow's own scalable font at ``size`` pixels (Pillow 10.1 or later: lenet.plot.can_plot)."""
    return ImageFont.load_default(size=size)


class Axes:
    """A panel of the figure: a data range mapped onto a box of pixels, its lines clipped to the box."""

    def __init__(self, size: tuple, box: tuple, x: tuple, y: tuple):
        self.box, self.x, self.y = box, x, y
        self.layer = Image.new("RGBA", size, (255, 255, 255, 0))   # the lines, cropped to the box
        self.draw = ImageDraw.Draw(self.layer)

    def at(self, x: float, y: float) -> tuple[float, float]:
        (l, t, r, b), (x0, x1), (y0, y1) = self.box, self.x, self.y
        return l + (x - x0) / (x1 - x0) * (r - l), b - (y - y0) / (y1 - y0) * (b - t)

    def line(self, xs, ys, color, width: float = 1.5, marker: float = 0.0) -> None:
        """A line through the points with finite coordinates (a gap at any other, None included), with round
        markers of radius ``marker`` pixels."""
        s = SCALE
        run: list[tuple[float, float]] = []
        for x, y in list(zip(xs, ys)) + [(None, None)]:
            if x is not None and y is not None and math.isfinite(x) and math.isfinite(y):
                run.append(self.at(x, y))
                continue
            near = [self._near(p) for p in run]
            if len(run) > 1 and all(near):
                self.draw.line(run, fill=color, width=max(1, round(width * s)), joint="curve")
            elif len(run) > 1:   # a point far outside (a diverged loss): each segment cut to the panel
                for a, b in zip(run, run[1:]):
                    cut = self._clip(a, b)
                    if cut:
                        self.draw.line(cut, fill=color, width=max(1, round(width * s)))
            for (px, py), ok in zip(run, near) if marker else ():
                m = marker * s
                if ok:
                    self.draw.ellipse([px - m, py - m, px + m, py + m], fill=color)
            run = []

    def _near(self, p) -> bool:
        """Whether pixel p is within a panel's size of the panel (drawn as it is; farther, cut first)."""
        l, t, r, b = self.box
        return l - (r - l) <= p[0] <= r + (r - l) and t - (b - t) <= p[1] <= b + (b - t)

    def _clip(self, a, b):
        """The part of segment a-b inside the panel's box (Liang-Barsky), or None."""
        l, t, r, bottom = self.box
        (x0, y0), (x1, y1) = a, b
        dx, dy, u0, u1 = x1 - x0, y1 - y0, 0.0, 1.0
        for p, q in ((-dx, x0 - l), (dx, r - x0), (-dy, y0 - t), (dy, bottom - y0)):
            if p == 0:
                if q < 0:
                    return None
                continue
            u = q / p
            if p < 0:
                u0 = max(u0, u)
            else:
                u1 = min(u1, u)
        if u0 > u1:
            return None
        return [(x0 + u0 * dx, y0 + u0 * dy), (x0 + u1 * dx, y0 + u1 * dy)]


class Figure:
    """A white figure of ``size`` pixels with an optional title; ``axes`` adds a panel, ``png`` draws it."""

    def __init__(self, size: tuple[int, int], title: str | None = None):
        self.size = size
        self.image = Image.new("RGB", (size[0] * SCALE, size[1] * SCALE), "white")
        self.draw = ImageDraw.Draw(self.image)
        self.font, self.title_font = _font(11 * SCALE), _font(13 * SCALE)
        self.panels: list[Axes] = []
        self.legends: list[tuple] = []   # drawn last, over the lines
        if title:
            self.text((self.image.width / 2, 8 * SCALE), title, self.title_font, anchor="mt")

    def text(self, at, text: str, font=None, anchor: str = "la", fill=INK) -> None:
        self.draw.text(at, text, fill=fill, font=font or self.font, anchor=anchor)

    def axes(self, box: tuple, x: tuple, y: tuple, xlabel: str, ylabel: str, x_integer: bool = False,
             nbins: int = 5, margin: float = 0.0, bounds: tuple = (None, None)) -> Axes:
        """A panel in ``box`` (left, top, right, bottom as fractions of the figure, from its top-left corner)
        showing ``x`` and ``y`` (data ranges; y widened by ``margin`` of its span on each side, then to its
        outer ticks, but not past ``bounds``; x to its outer ticks unless ``x_integer``, whose ticks are
        whole numbers within it), with a grid at the ticks, the axes' labels and a frame. Returns it for its
        lines."""
        w, h = self.image.size
        px = (box[0] * w, box[1] * h, box[2] * w, box[3] * h)
        pad = (y[1] - y[0]) * margin
        below, above = y[0] - pad, y[1] + pad
        if bounds[0] is not None:
            below = max(below, bounds[0])
        if bounds[1] is not None:
            above = min(above, bounds[1])
        yt = ticks(below, above, nbins)
        y_range = (yt[0] if bounds[0] is None else max(yt[0], bounds[0]),
                   yt[-1] if bounds[1] is None else min(yt[-1], bounds[1]))
        if y_range[1] <= y_range[0]:   # a flat curve on a bound: the ticks' range
            y_range = (yt[0], yt[-1])
        yt = [v for v in yt if y_range[0] <= v <= y_range[1]]
        xt = ticks(*x, nbins, x_integer)
        x_range = x if x_integer else (min(x[0], xt[0]), max(x[1], xt[-1]))
        if x_range[1] <= x_range[0]:
            x_range = (xt[0], xt[-1])
        xt = [v for v in xt if x_range[0] <= v <= x_range[1]] or [x_range[0]]
        ax = Axes(self.image.size, px, x_range, y_range)
        l, t, r, b = px
        s, tick = SCALE, 4 * SCALE
        x_step = xt[1] - xt[0] if len(xt) > 1 else 1.0
        y_step = yt[1] - yt[0] if len(yt) > 1 else 1.0
        for v in xt:
            gx, _ = ax.at(v, y_range[0])
            self.draw.line([(gx, t), (gx, b)], fill=GRID, width=s)
            self.draw.line([(gx, b), (gx, b + tick)], fill=INK, width=s)
            self.text((gx, b + tick + 2 * s), label(v, x_step), anchor="mt")
        for v in yt:
            _, gy = ax.at(x_range[0], v)
            self.draw.line([(l, gy), (r, gy)], fill=GRID, width=s)
            self.draw.line([(l - tick, gy), (l, gy)], fill=INK, width=s)
            self.text((l - tick - 3 * s, gy), label(v, y_step), anchor="rm")
        self.text(((l + r) / 2, b + tick + 17 * s), xlabel, anchor="mt")
        widest = max((self.draw.textlength(label(v, y_step), font=self.font) for v in yt), default=0)
        self._vertical(ylabel, l - tick - 8 * s - widest, (t + b) / 2)
        self.panels.append(ax)
        return ax

    def _vertical(self, text: str, right: float, middle: float) -> None:
        """``text`` turned a quarter to the left, its right edge at ``right``, centred on ``middle``."""
        box = self.draw.textbbox((0, 0), text, font=self.font)
        im = Image.new("RGBA", (box[2] - box[0] + 2, box[3] - box[1] + 2), (255, 255, 255, 0))
        ImageDraw.Draw(im).text((-box[0] + 1, -box[1] + 1), text, fill=INK, font=self.font)
        im = im.rotate(90, expand=True)
        self.image.paste(im, (round(right - im.width), round(middle - im.height / 2)), im)

    def legend(self, ax: Axes, entries: list[tuple[str, tuple]], where: str = "above") -> None:
        """A row of (label, colour) samples: ``above`` the panel's left corner, or ``inside`` its lower right
        on a white box; drawn over the lines (``png``)."""
        self.legends.append((ax, entries, where))

    def _legend(self, ax: Axes, entries: list[tuple[str, tuple]], where: str) -> None:
        s = SCALE
        widths = [22 * s + self.draw.textlength(text, font=self.font) + 12 * s for text, _ in entries]
        l, t, r, b = ax.box
        x, y = (l, t - 10 * s) if where == "above" else (r - sum(widths) - 6 * s, b - 14 * s)
        if where != "above":
            self.draw.rectangle([x - 6 * s, y - 9 * s, x + sum(widths) - 6 * s, y + 9 * s], fill="white",
                                outline=GRID, width=s)
        for (text, color), width in zip(entries, widths):
            self.draw.line([(x, y), (x + 18 * s, y)], fill=color, width=round(1.5 * s))
            self.draw.ellipse([x + 9 * s - 3 * s, y - 3 * s, x + 9 * s + 3 * s, y + 3 * s], fill=color)
            self.text((x + 22 * s, y), text, anchor="lm")
            x += width

    def png(self) -> bytes:
        """The figure as PNG bytes: each panel's lines over its grid, cropped to its box, then its frame, then
        the legends."""
        for ax in self.panels:
            box = tuple(round(v) for v in ax.box)
            self.image.paste(ax.layer.crop(box), box[:2], ax.layer.crop(box))
            self.draw.rectangle(box, outline=INK, width=SCALE)
        for legend in self.legends:
            self._legend(*legend)
        small = self.image.resize(self.size, Image.LANCZOS)
        buf = io.BytesIO()
        small.save(buf, format="png", compress_level=1)   # 6 (the default) doubles the encoding
        return buf.getvalue()


def data_range(values) -> tuple[float, float]:
    """The finite values' smallest and largest (0 .. 1 where there is none; None is not a value)."""
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    return (min(finite), max(finite)) if finite else (0.0, 1.0)

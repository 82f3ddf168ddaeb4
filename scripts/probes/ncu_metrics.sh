# The ncu metrics the stage-kernel probes read (instructions, pipes, shared-memory wavefronts, issue and the
# stall reasons), as one --metrics list:  ncu --metrics "$(bash scripts/probes/ncu_metrics.sh)" python3 ...
M=gpu__time_duration.sum,smsp__inst_executed.sum,smsp__inst_executed_pipe_fma.sum,smsp__inst_executed_pipe_tensor.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,sm__warps_active.avg.pct_of_peak_sustained_active
for r in barrier math_pipe_throttle mio_throttle short_scoreboard long_scoreboard wait not_selected dispatch_stall no_instruction branch_resolving; do M=$M,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio; done
echo $M

// The workbench's variants of the whole step in one launch of clusters (dev/step_cluster.py): each module is
// lenet/kernels/step_cluster.cu (compiled first: uses=) under other macros, with its phase clock (SC_PROFILE).
//   step_cluster_dev      what ships: one image a cluster, 512 threads a block, conv2's output gradient dense
//   _g2, _g8              two and eight images a cluster (eight blocks an image at one, one block at eight)
//   _t256                 256 threads a block
//   _routed               dp1 gathered through the argmax bytes (9 windows a channel) instead of dense
//   _acqrel               the cluster barrier with its default release/acquire in every thread
//   _syncs, _syncs_acqrel, _syncs_relaxed, _syncs_t256   ten more barriers in the first phase: a barrier's cost
//   _empty                returns at once: the launch floor of this shape
// module step_cluster_dev: arch=90 uses=stage_common,softmax_ce_row,head_common,sgd_rule,step_cluster define=SC_PROFILE
// module step_cluster_g2: arch=90 uses=stage_common,softmax_ce_row,head_common,sgd_rule,step_cluster define=SC_PROFILE define=SC_MAXG=2
// module step_cluster_g8: arch=90 uses=stage_common,softmax_ce_row,head_common,sgd_rule,step_cluster define=SC_PROFILE define=SC_MAXG=8
// module step_cluster_t256: arch=90 uses=stage_common,softmax_ce_row,head_common,sgd_rule,step_cluster define=SC_PROFILE define=SC_THREADS=256
// module step_cluster_routed: arch=90 uses=stage_common,softmax_ce_row,head_common,sgd_rule,step_cluster define=SC_PROFILE define=SC_DX_ROUTED define=SC_MAXG=8
// module step_cluster_acqrel: arch=90 uses=stage_common,softmax_ce_row,head_common,sgd_rule,step_cluster define=SC_PROFILE define=SC_ACQREL
// module step_cluster_syncs: arch=90 uses=stage_common,softmax_ce_row,head_common,sgd_rule,step_cluster define=SC_PROFILE define=SC_EXTRA_SYNCS=10
// module step_cluster_syncs_acqrel: arch=90 uses=stage_common,softmax_ce_row,head_common,sgd_rule,step_cluster define=SC_PROFILE define=SC_EXTRA_SYNCS=10 define=SC_ACQREL
// module step_cluster_syncs_relaxed: arch=90 uses=stage_common,softmax_ce_row,head_common,sgd_rule,step_cluster define=SC_PROFILE define=SC_EXTRA_SYNCS=10 define=SC_RELAXED
// module step_cluster_syncs_t256: arch=90 uses=stage_common,softmax_ce_row,head_common,sgd_rule,step_cluster define=SC_PROFILE define=SC_EXTRA_SYNCS=10 define=SC_THREADS=256
// module step_cluster_empty: arch=90 uses=stage_common,softmax_ce_row,head_common,sgd_rule,step_cluster define=SC_PROFILE define=SC_EMPTY

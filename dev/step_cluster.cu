// The workbench's variants of the whole step in one launch of clusters (dev/step_cluster.py): each module is
// lenet/kernels/step_cluster.cu (compiled first: uses=) under other macros, with its phase clock (SC_PROFILE).
//   step_cluster_dev      what ships as step_cluster: four barriers (Note [four barriers]), 512 threads a block
//   _t256_dev             what ships as step_cluster_t256: 256 threads a block
//   _g3, _g4, _g8         3, 4, 8 images a cluster (SC_MAXG; step_cluster_g2 and _g2_t256 ship 2); _g3_t256,
//                         _g4_t256 at 256 threads a block
//   _acqrel               the cluster barrier with its default release/acquire in every thread
//   _syncs, _syncs_acqrel, _syncs_relaxed, _syncs_t256   ten more barriers in the first phase: a barrier's cost
//   _empty                returns at once: the launch floor of this shape
// The form before Note [four barriers], seven barriers a step, is dev/step_cluster_v1.cu (step_cluster_v1).
// module step_cluster_dev: arch=90 uses=stage_common,softmax_ce_row,head_common,sgd_rule,step_common,step_cluster define=SC_PROFILE smem=11004
// module step_cluster_g4: arch=90 uses=stage_common,softmax_ce_row,head_common,sgd_rule,step_common,step_cluster define=SC_PROFILE define=SC_MAXG=4 smem=25824
// module step_cluster_g3: arch=90 uses=stage_common,softmax_ce_row,head_common,sgd_rule,step_common,step_cluster define=SC_PROFILE define=SC_MAXG=3 smem=20884
// module step_cluster_g3_t256: arch=90 uses=stage_common,softmax_ce_row,head_common,sgd_rule,step_common,step_cluster define=SC_PROFILE define=SC_MAXG=3 define=SC_THREADS=256 smem=20884
// module step_cluster_g8: arch=90 uses=stage_common,softmax_ce_row,head_common,sgd_rule,step_common,step_cluster define=SC_PROFILE define=SC_MAXG=8 smem=45584
// module step_cluster_g4_t256: arch=90 uses=stage_common,softmax_ce_row,head_common,sgd_rule,step_common,step_cluster define=SC_PROFILE define=SC_MAXG=4 define=SC_THREADS=256 smem=25824
// module step_cluster_t256_dev: arch=90 uses=stage_common,softmax_ce_row,head_common,sgd_rule,step_common,step_cluster define=SC_PROFILE define=SC_THREADS=256 smem=11004
// module step_cluster_acqrel: arch=90 uses=stage_common,softmax_ce_row,head_common,sgd_rule,step_common,step_cluster define=SC_PROFILE define=SC_ACQREL smem=11004
// module step_cluster_syncs: arch=90 uses=stage_common,softmax_ce_row,head_common,sgd_rule,step_common,step_cluster define=SC_PROFILE define=SC_EXTRA_SYNCS=10 smem=11004
// module step_cluster_syncs_acqrel: arch=90 uses=stage_common,softmax_ce_row,head_common,sgd_rule,step_common,step_cluster define=SC_PROFILE define=SC_EXTRA_SYNCS=10 define=SC_ACQREL smem=11004
// module step_cluster_syncs_relaxed: arch=90 uses=stage_common,softmax_ce_row,head_common,sgd_rule,step_common,step_cluster define=SC_PROFILE define=SC_EXTRA_SYNCS=10 define=SC_RELAXED smem=11004
// module step_cluster_syncs_t256: arch=90 uses=stage_common,softmax_ce_row,head_common,sgd_rule,step_common,step_cluster define=SC_PROFILE define=SC_EXTRA_SYNCS=10 define=SC_THREADS=256 smem=11004
// module step_cluster_empty: arch=90 uses=stage_common,softmax_ce_row,head_common,sgd_rule,step_common,step_cluster define=SC_PROFILE define=SC_EMPTY smem=11004

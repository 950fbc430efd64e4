"""The `triton` backend; nothing here imports the modules that use it (registry, routing kinds, build_router,
train, tools, cli: tests/test_layers.py). CUDA, or Triton's CPU interpreter under TRITON_INTERPRET=1.

    kernels.py   every @triton.jit kernel and the math they compute: the single read (read_fwd, read_bwd) and
                 the two-phase block reads (group_fwd / merge_fwd and their backward); Triton only, loadable
                 without torch
    launch.py    whether the kernels can run here, where launches go, the launch geometry and pointer table
    ops.py       torch custom ops with fakes and hand-written autograd: the single read, the two-phase reads
    router.py    the AttnRes router that calls the ops

Which specialisations the model launches, and their compile check for sm_80/90/100: tools/kernels/.
"""

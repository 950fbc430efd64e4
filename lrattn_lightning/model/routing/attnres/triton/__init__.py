"""The `triton` backend: kernels.py (Triton only: the fused depth reads, forward and backward; never imports the
modules that use it), ops.py (torch custom ops with fakes and hand-written autograd over them), router.py (the
AttnRes router that calls the ops). CUDA, or Triton's CPU interpreter under TRITON_INTERPRET=1."""

"""The `triton` backend's launches checked without a GPU: specs.py (which kernel specialisations the model
launches, recorded by driving every AttnRes registry entry's router; `python -m lrattn_lightning.tools.kernels.specs`)
and compile_check.py (compiles them for sm_80/90/100 and reads registers, spills and shared memory; needs only
triton: no torch, nothing of this package). The kernels themselves (model/routing/attnres/triton/) never import
these."""

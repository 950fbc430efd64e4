"""lrattn_lightning: attention residuals (AttnRes, P-LR-AttnRes, S-LR-AttnRes) on Lightning."""

__version__ = "0.1.0"

"""Ranks and their process groups over torch.distributed (tensor and pipeline parallelism):
what a model's layers call to sum, gather and pass tensors between ranks, and how a rank's
CPU threads are bound (docs/PARALLELISM.md)."""

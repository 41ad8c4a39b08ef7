"""ckpt-record: writes `ckpt-record/1` run records (docs/RECORD.md) from PyTorch training, so
that ckpt-harness can judge the run. `Recorder` serves a plain loop; `ckpt_record.hf` holds the
Hugging Face Trainer's callback."""

from .recorder import RECORD_VERSION, Recorder, training_state

__all__ = ["RECORD_VERSION", "Recorder", "training_state"]

"""Checkpoints: Hugging Face compatible directories, tier slices, manifest and loader."""

from matformer.modeling.checkpoint.pretrained import load_pretrained, read_config, save_pretrained

__all__ = ["load_pretrained", "read_config", "save_pretrained"]

"""Saved command outputs: which files a bundle has (files), writing one from the live
node (write), and reading any saved or pasted outputs back into a snapshot (load)."""

from agent.bundle.load import load_bundle, load_texts, read_input, with_kube_json

__all__ = ["load_bundle", "load_texts", "read_input", "with_kube_json"]

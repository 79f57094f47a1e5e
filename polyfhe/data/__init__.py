"""Local datasets only: nothing here downloads. Users bring files; we read them."""

from polyfhe.data.idx import read_idx
from polyfhe.data.sources import ImageDataset, available_sources, detect_source, load_dataset, open_dataset

__all__ = ["ImageDataset", "available_sources", "detect_source", "load_dataset", "open_dataset", "read_idx"]

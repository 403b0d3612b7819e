"""One captured training sequence: tokens, features, labels, and which positions are response
text (what data.py produces, store.py keeps on disk, and training reads). Defined beside the
part format in speculative/parts.py, which serving's capture writes too."""

from trtspec.speculative.parts import SOFT_TOP_K, FeatureRows, Sample

__all__ = ["SOFT_TOP_K", "FeatureRows", "Sample"]

"""The contracts between dataprep, loader and replay: config schema, record codec, manifest.

Imports neither Beam nor JAX (docs/design.md, "Dependency direction").
"""

from contract.codec import FORMAT_VERSION, PackedRow, RecordError, decode_row, dense_row, encode_row
from contract.config import ConfigError, MixtureConfig, load_mixture, mixture_from_dict
from contract.hashing import derive_seed, document_key, stable_hash64
from contract.manifest import MANIFEST_NAME, Manifest, ManifestError, shard_name

__all__ = [
    "FORMAT_VERSION", "PackedRow", "RecordError", "decode_row", "dense_row", "encode_row",
    "ConfigError", "MixtureConfig", "load_mixture", "mixture_from_dict",
    "derive_seed", "document_key", "stable_hash64",
    "MANIFEST_NAME", "Manifest", "ManifestError", "shard_name",
]

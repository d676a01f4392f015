"""dataprep: the Apache Beam pipeline that tokenizes and packs corpora into ArrayRecord shards.

Entry points (see docs/dataprep.md)::

    python -m dataprep.demo --out build/demo
    python -m dataprep.train_tokenizer --config configs/mixtures/<name>.yaml \
        --vocab-size 32000 --out tok.model
    python -m dataprep.pack --config configs/mixtures/<name>.yaml --output <dir or gs://...> [Beam options]

Library functions that tests and other tools call: :func:`dataprep.pack.run`,
:func:`dataprep.preflight.preflight`, :mod:`dataprep.packing` (pure packing),
:mod:`dataprep.readers` (input formats), :func:`dataprep.train_tokenizer.train`.
"""

import logging as _logging


class _BeamImportNoise(_logging.Filter):
    """Drops the one warning Beam logs on import when its GCP extras are absent.

    ``apache_beam.io.gcp.bigquery`` logs "apitools not found, and bigquery client libraries
    are not available ..." through the root logger on every import: noise in every command's
    output when no GCP extra is installed (``pip install -e ".[dataflow]"`` installs them).
    """

    def filter(self, record: _logging.LogRecord) -> bool:
        return "apitools not found" not in record.getMessage()


_logging.getLogger().addFilter(_BeamImportNoise())

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

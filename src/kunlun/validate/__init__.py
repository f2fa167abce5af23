"""The validation suite: one standard battery on every device pool, as a chip-by-test matrix.

``kunlun-cli validate`` runs the functional battery of the day-one adaptation manual (short
and long text, five-turn memory, concurrency, special characters, temperature, a batch
through the batch runner), API conformance, a garbage detector over every answer, a short
performance sweep and cross-pool numerics against a reference, on each target
(:mod:`~kunlun.validate.target`), and writes the matrix (:mod:`~kunlun.validate.report`).

Modules: ``matrix`` (cells, rows, columns, JSON), ``target`` (columns and pools), ``client``
(requests that record answers and devices; SSE parsing), ``garbage`` (the detector),
``check`` (the check contract), ``functional``, ``conformance``, ``performance``,
``numerics`` (the checks), ``baseline`` (the regression gate), ``battery`` (the runner),
``report`` (Markdown, HTML, JSON, JUnit XML, rich), ``relay`` (the batch runner to one pool).
"""

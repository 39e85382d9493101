"""Research probes: measuring instruments for one question each (a layout, a kernel setting, a lever), not the
figures users are pointed to. Each runs from the repository root as ``python -m benchmarks.probes.NAME`` (its
docstring gives the commands) and shares the command-line, JSON and table helpers of ``benchmarks/_common.py``.

- ``attention``: one layer's decode-step attention on codes against SDPA (codecs, model shapes, kernel row plans);
- ``baselines``: mlx-lm's own caches (KVCache, QuantizedKVCache 8/4/2 bits) measured before ours existed;
- ``calibration``: calibrated caches against uncalibrated ones, and the calibration's levers;
- ``chunk_prefill``: a short prompt chunk on top of a history, as a server's prompt cache sees it;
- ``coded_tail``: issue 47's coded tail: provisional keys centred or not, short-chat answers, kernel parity;
- ``distortion``: the quantizers' distortion, bytes and throughput on random unit vectors (the paper's figures);
- ``generate_peak``: peak memory of mlx_lm's ``generate_step`` after ``enable(model)``, per registered method;
- ``layer_sensitivity``: where a budget configuration's KL comes from, layer by layer (issue 28's diagnosis);
- ``mla_memory``: bytes per token of one MLA layer (DeepSeek-V3's shape) in mlx_lm's caches and ours;
- ``prefill_peak``: peak memory of a chunked prefill by attention setting (query block, fused exponential);
- ``probe_quality``: quantization recipes screened by a layer-local proxy, then end to end (with the key weighting
  of ``benchmarks/_key_weighting.py``, kept there: tests/codecs/test_key_weighting.py imports it from there; the
  recipes themselves and their bits accounting in ``_quality_recipes.py``, a helper, not a probe);
- ``softmax_exp``: the softmax exponential, ``mx.exp`` against ``exp2_nonpositive``;
- ``standalone_cache``: speed of the seed pages' standalone ``TurboQuantKVCache``;
- ``step_profile``: where a decode step's time goes (store, attention, the rest): a diagnosis, not a speed figure.
"""

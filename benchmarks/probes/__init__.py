"""Research probes: measuring instruments for one question each (a layout, a kernel setting, a lever), not the
figures users are pointed to. Each runs from the repository root as ``python -m benchmarks.probes.NAME`` (its
docstring gives the commands) and shares the command-line, JSON and table helpers of ``benchmarks/_common.py``.
The probes kept are those that inform open work (the 4-bit tier's coded tail and keys before RoPE, per-layer bits,
decode-step speed, the quantizers' distortion); the ones the user-facing benchmarks superseded were removed, their
runs recorded in docs/history/benchmarks-journal.md.

- ``attention``: one layer's decode-step attention on codes against SDPA (codecs, model shapes, kernel row plans);
- ``calibration``: calibrated caches against uncalibrated ones, and the calibration's levers;
- ``coded_tail``: issue 47's coded tail: provisional keys centred or not, short-chat answers, kernel parity;
- ``distortion``: the quantizers' distortion, bytes and throughput on random unit vectors (the paper's figures);
- ``layer_sensitivity``: where a budget configuration's KL comes from, layer by layer (issue 28's diagnosis);
- ``prerope_scoring``: what scoring keys stored before RoPE would cost a decode step, in pure MLX (issue 47);
- ``step_profile``: where a decode step's time goes (store, attention, the rest): a diagnosis, not a speed figure.

Each has ``--smoke``: its code paths end to end in seconds, on a tiny random llama (``_smoke.py``, a helper, not a
probe) or on small random tensors, figures meaningless; tests/benchmarks/test_probes.py runs every probe so (a new
probe comes with its ``--smoke`` and its test there).
"""

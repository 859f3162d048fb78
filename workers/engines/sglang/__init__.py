"""The production engine: a capture plugin for a stock ``sglang`` server and its launcher.

``launcher.main(argv)`` starts SGLang's own HTTP server with :func:`plugin.run_scheduler_process` as the
scheduler entry point; the plugin captures hidden states inside each scheduler process and dumps them per
request as the engine protocol in :mod:`hsx.contract` says. Nothing here imports torch or sglang at import
time: both modules are loaded inside the SGLang environment only. See ``docs/sglang.md``.
"""

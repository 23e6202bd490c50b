"""A truth source for revenant: SGLang 0.5.23's own PD disaggregation code in worker
processes whose model and scheduler are played by this package (see README.md)."""

SGLANG_VERSION = "0.5.23"

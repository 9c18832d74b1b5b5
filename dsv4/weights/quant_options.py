"""The choices of ``dsv4 quantize`` / ``eval-quant`` (no torch here: ``dsv4 --help`` builds its
parser from these without importing the quantizer; :mod:`.quantize` documents what each means)."""

FORMATS = ("nvfp4", "mxfp4", "fp8")
POLICIES = ("floor", "all")
DENSE_FORMATS = ("fp8", "same")
SCALE_FMTS = ("ue8m0", "fp32")

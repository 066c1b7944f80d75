"""Two kvpolicy backends that wrap third-party quantizers: ``quanto`` (optimum-quanto's group-wise affine
``qint2`` / ``qint4`` tensors, :mod:`kvpolicy_quanto_hqq.quanto_backend`) and ``hqq`` (HQQ's half-quadratic
quantizer, :mod:`kvpolicy_quanto_hqq.hqq_backend`).

kvpolicy finds them through the entry point (:mod:`kvpolicy_quanto_hqq.plugin`); nothing imports this package
by hand.
"""

#: what ``pip install`` takes to install this plugin and the libraries behind its backends (from the kvpolicy
#: repository root), for the messages of a missing library
INSTALL = "./plugins/kvpolicy-quanto-hqq"

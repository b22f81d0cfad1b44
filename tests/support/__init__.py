"""What the tests share besides fixtures, imported by this package's name
(``from support.helpers import Clock``): ``models`` (tiny configs and data), ``helpers``
(run configs, a still clock), ``rounds`` (driving a coordinator in-process), ``wire`` (a
served coordinator and raw gRPC calls), ``certs`` (self-signed TLS), ``openapi`` (checking
responses against the API's schema). The folder ``tests/`` is on ``sys.path`` as pytest's
rootdir; scripts there (``dp_gradient.py``, ``fuzz_rpc.py``) import it the same way."""

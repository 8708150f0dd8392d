"""schemathesis hooks (``SCHEMATHESIS_HOOKS``) for the Tinker API's document: its
``forward_backward`` body is ``application/x-protobuf`` bytes, sent as raw binary like
``application/octet-stream``, so the fuzzer can send what it generates."""

import schemathesis

schemathesis.serializer.alias("application/x-protobuf", "application/octet-stream")

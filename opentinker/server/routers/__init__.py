"""One router per resource, all mounted under ``/v1`` (protocol.API_PREFIX)."""

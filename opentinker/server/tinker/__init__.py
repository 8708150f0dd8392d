"""The Tinker API (``/api/v1``): the official ``tinker`` SDK and the tinker-cookbook recipes run
against this server unmodified. Routes in :mod:`.routes`, wire format in :mod:`.wire`, durable
state in :mod:`.state` and :mod:`.futures`, the Ray side in :mod:`.host`, all tied together by
:mod:`.service`."""

"""A read NIXL cannot cancel is reported, however often (and by whichever path) it is released."""

import pytest

from pd.transfer import nixl_available

pytestmark = pytest.mark.skipif(not nixl_available(), reason="needs a NIXL package")


class Handle:
    def __init__(self, cancellable: bool) -> None:
        self.cancellable = cancellable

    def release(self) -> None:
        if not self.cancellable:
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")


def test_release_reports_reads_that_could_not_be_cancelled():
    from pd.transfer.nixl_backend import NixlBackend

    backend = NixlBackend("release-test", progress_thread=False)
    try:
        backend._xfers[1] = ("peer", [Handle(True)])
        backend._xfers[2] = ("peer", [Handle(True), Handle(False)])
        assert backend.release(1) is True
        assert backend.release(2) is False
        assert backend.release(2) is False  # again, e.g. after the dead peer's cleanup ran first
        assert backend.release(1) is True
    finally:
        backend.close()

"""The servers' command lines name a bad port or worker count at parse time (exit 2)."""

from __future__ import annotations

import pytest

from llmgw.asgi.proxy import main as proxy_main
from llmgw.extproc.server import build_parser


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "99999"], "99999 is not a port: give 0-65535"),
        (["--port", "http"], "'http' is not a port number"),
        (["--workers", "0"], "0 must be >= 1"),
    ],
)
def test_the_proxy_refuses_a_bad_port_or_worker_count(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """uvloop wrapped --port 99999 to 34463 and listened there, logging 99999."""
    with pytest.raises(SystemExit) as exit_:
        proxy_main(["--config", "unread.yaml", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag", ["--grpc-port", "--grpc-health-port", "--health-port", "--metrics-port"]
)
def test_the_extproc_server_refuses_a_port_out_of_range(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--config", "x.yaml", flag, "70000"])
    assert "70000 is not a port" in capsys.readouterr().err
    assert (
        getattr(
            build_parser().parse_args(["--config", "x.yaml", flag, "0"]), flag[2:].replace("-", "_")
        )
        == 0
    )


def test_the_extproc_server_refuses_zero_workers(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--config", "x.yaml", "--workers", "0"])
    assert "0 must be >= 1" in capsys.readouterr().err

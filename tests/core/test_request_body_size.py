"""`check_body_size`: one wording of the 413 for both edges, whole or streamed bodies."""

from __future__ import annotations

import pytest

from llmgw.errors import BodyTooLarge
from llmgw.request import check_body_size, parse_body


def test_body_at_the_limit_passes() -> None:
    check_body_size(1024, 1024)


def test_complete_body_over_the_limit_names_its_size() -> None:
    with pytest.raises(BodyTooLarge, match="request body is 1025 bytes; the limit is 1024"):
        check_body_size(1025, 1024)


def test_partial_body_over_the_limit_says_more_than() -> None:
    with pytest.raises(BodyTooLarge, match="request body is more than 1024 bytes"):
        check_body_size(4096, 1024, complete=False)


def test_parse_body_uses_the_same_check() -> None:
    with pytest.raises(BodyTooLarge) as info:
        parse_body(b"x" * 2000, max_bytes=1024, prefix_chars=10)
    assert info.value.status == 413
    assert info.value.code == "body_too_large"

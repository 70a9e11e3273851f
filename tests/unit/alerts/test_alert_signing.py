"""Webhook signing: the signature format, every way verification fails, and key rotation."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from dsec.alerts.signing import SignatureError, sign, sign_all, verify

BODY = b'{"alerts": []}'
NOW = 1_700_000_000


def test_sign_is_v1_hmac_sha256_over_timestamp_dot_body() -> None:
    expected = hmac.new(b"s3cret", b"1700000000." + BODY, hashlib.sha256).hexdigest()
    assert sign("s3cret", NOW, BODY) == f"v1={expected}"
    assert sign(b"s3cret", NOW, BODY) == sign("s3cret", NOW, BODY)


def test_roundtrip_verifies_within_tolerance_both_ways() -> None:
    header = sign("s3cret", NOW, BODY)
    verify("s3cret", str(NOW), header, BODY, now=NOW)
    verify("s3cret", str(NOW), header, BODY, now=NOW + 300)
    verify("s3cret", str(NOW), header, BODY, now=NOW - 300)


@pytest.mark.parametrize("ts", ["", "  ", None])
def test_missing_timestamp(ts: str | None) -> None:
    with pytest.raises(SignatureError, match="missing X-DSec-Timestamp"):
        verify("s3cret", ts, sign("s3cret", NOW, BODY), BODY, now=NOW)


@pytest.mark.parametrize("ts", ["17e8", "-5", "1.5", "\uff11\uff12", "9" * 40])
def test_malformed_timestamp(ts: str) -> None:
    with pytest.raises(SignatureError, match="malformed X-DSec-Timestamp"):
        verify("s3cret", ts, sign("s3cret", NOW, BODY), BODY, now=NOW)


def test_stale_timestamp_is_a_replay() -> None:
    with pytest.raises(SignatureError, match=r"stale X-DSec-Timestamp 1700000000: 301 s old, tolerance is 300 s"):
        verify("s3cret", str(NOW), sign("s3cret", NOW, BODY), BODY, now=NOW + 301)


def test_future_timestamp() -> None:
    with pytest.raises(SignatureError, match=r"60 s in the future, tolerance is 30 s"):
        verify("s3cret", str(NOW), sign("s3cret", NOW, BODY), BODY, now=NOW - 60, tolerance_s=30)


@pytest.mark.parametrize("header", ["", None, " , "])
def test_missing_signature(header: str | None) -> None:
    with pytest.raises(SignatureError, match="missing X-DSec-Signature"):
        verify("s3cret", str(NOW), header, BODY, now=NOW)


def test_unknown_scheme() -> None:
    digest = sign("s3cret", NOW, BODY).removeprefix("v1=")
    with pytest.raises(SignatureError, match=r"no v1 signature in X-DSec-Signature \(found schemes: <none>, v0\)"):
        verify("s3cret", str(NOW), f"v0={digest},{digest}", BODY, now=NOW)


@pytest.mark.parametrize(
    ("secret", "ts", "body"),
    [("wrong", NOW, BODY), ("s3cret", NOW + 1, BODY), ("s3cret", NOW, BODY + b" ")],
    ids=["secret", "timestamp", "body"],
)
def test_mismatch(secret: str, ts: int, body: bytes) -> None:
    header = sign(secret, ts, body)
    with pytest.raises(SignatureError, match="X-DSec-Signature mismatch"):
        verify("s3cret", str(NOW), header, BODY, now=NOW)


def test_key_rotation_sender_signs_with_both_secrets() -> None:
    header = sign_all(["old", "new"], NOW, BODY)
    assert header == f"{sign('old', NOW, BODY)},{sign('new', NOW, BODY)}"
    verify("old", str(NOW), header, BODY, now=NOW)  # receiver not yet rotated
    verify("new", str(NOW), header, BODY, now=NOW)  # receiver already rotated
    with pytest.raises(SignatureError, match="mismatch"):
        verify("other", str(NOW), header, BODY, now=NOW)


def test_key_rotation_receiver_accepts_either_secret_and_ignores_other_schemes() -> None:
    header = f"v0=deadbeef, junk ,{sign('new', NOW, BODY)}"
    verify(["old", "new"], str(NOW), header, BODY, now=NOW)
    verify([b"old", b"new"], str(NOW), sign("old", NOW, BODY), BODY, now=NOW)


def test_empty_secrets_and_bad_tolerance_are_programming_errors() -> None:
    with pytest.raises(ValueError, match="secret must be non-empty"):
        sign("", NOW, BODY)
    with pytest.raises(ValueError, match="at least one secret"):
        verify([], str(NOW), "v1=00", BODY, now=NOW)
    with pytest.raises(ValueError, match="tolerance_s=-1"):
        verify("s", str(NOW), "v1=00", BODY, now=NOW, tolerance_s=-1)

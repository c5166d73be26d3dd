"""Bus URLs: Kafka TLS/SASL options and the Redis password file reach the client libraries, and a secret
never has to sit in the URL (so neither logs nor `--check-config` can show it)."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from alignedserve.bus.kafka import KafkaSecurity, parse_url, parse_url_security
from alignedserve.bus.redis_streams import RedisStreamsBus, split_url
from alignedserve.core.config import MASK, mask_url_password


def test_a_plain_kafka_url_needs_no_security() -> None:
    bootstrap, options, security = parse_url_security("kafka://k1:9092,k2:9092?partitions=4")
    assert bootstrap == "k1:9092,k2:9092" and options.partitions == 4
    assert security == KafkaSecurity()
    assert security.client_kwargs() == {"security_protocol": "PLAINTEXT"}
    assert parse_url("kafka://k1:9092")[0] == "k1:9092"  # the two-value form tests use


def test_kafka_sasl_ssl_reads_the_password_file_and_builds_a_tls_context(tmp_path: Path) -> None:
    password = tmp_path / "password"
    password.write_text("s3cret\n")
    url = (
        "kafka://broker:9093?security_protocol=SASL_SSL&sasl_mechanism=SCRAM-SHA-512"
        f"&sasl_username=alignedserve&sasl_password_file={password}&session_timeout_ms=6000"
    )
    _, options, security = parse_url_security(url)
    assert options.session_timeout_ms == 6000
    kwargs = security.client_kwargs()
    assert kwargs["security_protocol"] == "SASL_SSL"
    assert kwargs["sasl_mechanism"] == "SCRAM-SHA-512"
    assert kwargs["sasl_plain_username"] == "alignedserve"
    assert kwargs["sasl_plain_password"] == "s3cret"
    assert isinstance(kwargs["ssl_context"], ssl.SSLContext)
    assert "s3cret" not in url


@pytest.mark.parametrize(
    ("query", "problem"),
    [
        ("security_protocol=TLS", "security_protocol must be one of"),
        ("security_protocol=SASL_SSL&sasl_username=u", "needs sasl_username and sasl_password_file"),
        ("sasl_mechanism=GSSAPI", "sasl_mechanism must be one of"),
        ("ssl_certfile=/c.pem", "go together"),
        ("partitions=four", "non-negative integers"),
        ("sasl_password=x", "unknown Kafka bus option"),
    ],
)
def test_bad_kafka_security_options_say_what_is_wrong(query: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_url_security(f"kafka://broker:9093?{query}")


def test_redis_password_file_and_tls_options_reach_redis_py(tmp_path: Path) -> None:
    password = tmp_path / "password"
    password.write_text("s3cret\n")
    url = f"rediss://redis:6380/0?password_file={password}&ssl_ca_certs=/etc/ca.crt&maxlen=10"
    rest, options = split_url(url)
    assert options.password_file == str(password) and options.maxlen == 10
    assert "password_file" not in rest and "ssl_ca_certs=%2Fetc%2Fca.crt" in rest
    kwargs = RedisStreamsBus(url)._redis.connection_pool.connection_kwargs
    assert kwargs["password"] == "s3cret"
    assert kwargs["ssl_ca_certs"] == "/etc/ca.crt"


def test_a_password_written_in_a_url_is_masked_when_shown() -> None:
    assert mask_url_password("redis://:pw@redis:6379/0") == f"redis://:{MASK}@redis:6379/0"
    assert mask_url_password("redis://user:pw@redis/0") == f"redis://user:{MASK}@redis/0"
    for text in ("kafka://k:9092", "rediss://user@redis/0", "gateway-7f9c", "0.0.0.0", "[::1"):
        assert mask_url_password(text) == text

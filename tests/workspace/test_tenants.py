"""Tenant keys: keyed digests of cache salts, and the secret behind them."""
import os
import stat

import pytest

from vllm_sekv.workspace.hashing import extend_block_hashes
from vllm_sekv.workspace.tenants import SECRET_FILE, TenantKeys, resolve_secret, tenant_bytes


def test_a_salt_names_one_tenant_and_only_the_secret_can_say_which():
    one, two = TenantKeys(b"s" * 32), TenantKeys(b"t" * 32)
    assert one.of("acme") == one.of("acme") != one.of("other")
    assert one.of("acme") != two.of("acme")  # without the secret, a guessed salt confirms nothing
    # the block-hash chain starts from the tenant key: no shared block across secrets either
    assert extend_block_hashes([], [1] * 8, 8, one.of("acme")) != extend_block_hashes([], [1] * 8, 8, two.of("acme"))
    assert len(tenant_bytes(one.of("acme"))) == 16 and tenant_bytes(one.of("acme")).hex() == one.of("acme")


def test_the_secret_is_made_once_owner_only_and_found_again(tmp_path):
    os.umask(0o022)
    first = resolve_secret("", tmp_path)
    path = tmp_path / SECRET_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert resolve_secret("", tmp_path) == first  # a restarted server keys tenants the same
    os.chmod(path, 0o644)
    assert resolve_secret("", tmp_path) == first and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert resolve_secret("a configured secret!", tmp_path) == b"a configured secret!"
    assert resolve_secret("", None) != resolve_secret("", None)  # no folder: one per process


def test_short_secrets_are_refused():
    with pytest.raises(ValueError, match="hash_secret"):
        TenantKeys(b"short")

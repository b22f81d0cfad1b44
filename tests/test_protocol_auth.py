"""Session tokens: issued per client, compared in constant time, revocable."""

from __future__ import annotations

import hashlib

from matformer.protocol.auth import SessionTokens, new_join_token, token_hash, tokens_equal


def test_a_token_names_its_client_until_revoked() -> None:
    sessions = SessionTokens()
    token = sessions.issue("client-1")
    assert token.startswith("client-1.") and sessions.client_of(token) == "client-1"
    sessions.revoke("client-1")
    assert sessions.client_of(token) is None


def test_a_new_token_replaces_the_old_one() -> None:
    sessions = SessionTokens()
    old = sessions.issue("client-1")
    new = sessions.issue("client-1")
    assert sessions.client_of(old) is None and sessions.client_of(new) == "client-1"


def test_forged_tokens_name_no_client() -> None:
    sessions = SessionTokens()
    token = sessions.issue("a.b")  # client ids may contain dots
    assert sessions.client_of(token) == "a.b"
    secret = token.rpartition(".")[2]
    forgeries = ("", "a.b", "a.b." + "x" * len(secret), secret, "c2." + secret, token + "x")
    for forged in forgeries:
        assert sessions.client_of(forged) is None


def test_tokens_survive_a_restart_through_plain_data() -> None:
    sessions = SessionTokens()
    token = sessions.issue("client-1")
    assert SessionTokens(sessions.as_dict()).client_of(token) == "client-1"


def test_only_hashes_are_kept_so_the_saved_data_authenticates_no_one() -> None:
    sessions = SessionTokens()
    token = sessions.issue("client-1")
    saved = sessions.as_dict()
    assert saved == {"client-1": "sha256:" + hashlib.sha256(token.encode()).hexdigest()}
    assert token not in str(saved) and token.rpartition(".")[2] not in str(saved)
    restored = SessionTokens(saved)
    assert restored.client_of(saved["client-1"]) is None  # the hash is no token
    assert restored.client_of(f"client-1.{saved['client-1']}") is None


def test_tokens_saved_in_clear_before_are_hashed_on_load() -> None:
    old = {"client-1": "client-1.old-secret"}  # a state.json from before tokens were hashed
    sessions = SessionTokens(old)
    assert sessions.client_of("client-1.old-secret") == "client-1"
    assert sessions.as_dict() == {"client-1": token_hash("client-1.old-secret")}
    assert SessionTokens(sessions.as_dict()).client_of("client-1.old-secret") == "client-1"


def test_helpers() -> None:
    assert tokens_equal("abc", "abc") and not tokens_equal("abc", "abd")
    assert not tokens_equal("é", "e")  # non-ASCII compares as UTF-8 bytes
    assert new_join_token() != new_join_token() and len(new_join_token()) >= 32

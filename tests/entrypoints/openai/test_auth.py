"""API keys in-process: key files, 401s, and the cache salt each key's requests get."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.testclient import TestClient

from tokenserve.entrypoints.openai.auth import (
    APIKeyMiddleware,
    effective_cache_salt,
    load_api_keys,
)
from tokenserve.entrypoints.openai.errors import install_error_handlers


def salt_echo_app(keys: list[str], salt_per_key: bool = True) -> TestClient:
    """An app whose /salt answers with the cache salt a request would run with."""
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(APIKeyMiddleware, api_keys=keys, salt_per_key=salt_per_key)

    @app.get("/salt")
    async def salt(raw_request: HTTPRequest, cache_salt: str | None = None) -> dict:
        return {"salt": effective_cache_salt(raw_request, cache_salt)}

    @app.get("/health")
    async def health() -> dict:
        return {}

    return TestClient(app)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_key_file_lines_comments_and_duplicates(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# tenants\nalpha\n\n  beta  \nalpha\n")
    assert load_api_keys(["gamma"], str(path)) == ["gamma", "alpha", "beta"]
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="no key"):
        load_api_keys(None, str(empty))
    with pytest.raises(ValueError, match="Cannot read"):
        load_api_keys(None, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="non-empty"):
        load_api_keys([""], None)


def test_every_configured_key_is_accepted_and_others_are_401():
    with salt_echo_app(["alpha", "beta"]) as client:
        assert client.get("/salt", headers=bearer("alpha")).status_code == 200
        assert client.get("/salt", headers=bearer("beta")).status_code == 200
        for headers in ({}, bearer("gamma"), bearer("alph"), {"Authorization": "Basic alpha"}):
            response = client.get("/salt", headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/health").status_code == 200  # unguarded


def test_each_key_gets_its_own_salt_and_a_request_salt_splits_it_further():
    with salt_echo_app(["alpha", "beta"]) as client:

        def salt(key: str, **params: str) -> str:
            return client.get("/salt", headers=bearer(key), params=params).json()["salt"]

        alpha, beta = salt("alpha"), salt("beta")
        assert alpha != beta and salt("alpha") == alpha
        # The salt reveals nothing of the key.
        assert "alpha" not in alpha and "beta" not in beta
        assert salt("alpha", cache_salt="mine") == f"{alpha}:mine"
        assert salt("alpha", cache_salt="mine") != salt("beta", cache_salt="mine")
        response = client.get("/salt", headers=bearer("alpha"), params={"cache_salt": ""})
        assert response.status_code == 400


def test_shared_prefix_cache_across_keys_adds_no_salt():
    with salt_echo_app(["alpha", "beta"], salt_per_key=False) as client:
        assert client.get("/salt", headers=bearer("alpha")).json()["salt"] is None
        response = client.get("/salt", headers=bearer("beta"), params={"cache_salt": "s"})
        assert response.json()["salt"] == "s"


def test_salt_needs_no_middleware():
    # Without keys a request's own salt is used as it is.
    app = FastAPI()

    @app.get("/salt")
    async def salt(raw_request: HTTPRequest) -> dict:
        return {"salt": effective_cache_salt(raw_request, "own")}

    with TestClient(app) as client:
        assert client.get("/salt").json() == {"salt": "own"}

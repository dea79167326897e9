"""Checks that Rialto's answers match the OpenAPI document it publishes.

Run by tests/e2e/python.rs against a sandbox (base URL, operator token and a
model id in the environment). Every exchange below is validated, request and
response, with openapi-core against GET /openapi.yaml; exits non-zero on the
first mismatch.
"""

import os
import sys

import requests
import yaml
from openapi_core import OpenAPI
from openapi_core.contrib.requests import RequestsOpenAPIRequest, RequestsOpenAPIResponse

root = os.environ["RIALTO_E2E_ROOT_URL"].rstrip("/")
operator = os.environ["RIALTO_E2E_OPERATOR_TOKEN"]
model = os.environ["RIALTO_E2E_MODEL"]

document = requests.get(f"{root}/openapi.yaml", timeout=30)
assert document.status_code == 200, document.status_code
spec = yaml.safe_load(document.text)
assert spec["info"]["version"] == document.headers["x-rialto-version"], spec["info"]["version"]
openapi = OpenAPI.from_dict(spec)

checked = 0


def check(response, expected_status, valid_request=True):
    """Validates one exchange against the document (the request too, unless
    it is deliberately invalid)."""
    global checked
    request = RequestsOpenAPIRequest(response.request)
    assert response.status_code == expected_status, (
        f"{response.request.method} {response.request.url}: {response.status_code} {response.text[:500]}"
    )
    try:
        if valid_request:
            openapi.validate_request(request)
        openapi.validate_response(request, RequestsOpenAPIResponse(response))
    except Exception as error:  # noqa: BLE001 - report any mismatch with its exchange
        details = getattr(error, "__cause__", None) or error
        sys.exit(
            f"{response.request.method} {response.request.url} -> {response.status_code} "
            f"does not match the OpenAPI document: {error!r}: {details!r}\nbody: {response.text[:1000]}"
        )
    checked += 1
    return response


session = requests.Session()
api = f"{root}/api/v1"

account = check(
    session.post(f"{root}/admin/v1/accounts", json={"name": "conformance"},
                 headers={"Authorization": f"Bearer {operator}"}),
    201,
).json()
admin = {"Authorization": f"Bearer {account['api_key']['key']}"}

created = check(
    session.post(f"{api}/api_keys", json={"apiKeyType": "INFERENCE", "description": "conformance"}, headers=admin),
    200,
).json()["data"]
inference = {"Authorization": f"Bearer {created['apiKey']}"}
check(session.get(f"{api}/api_keys", headers=admin), 200)
check(session.get(f"{api}/api_keys/{created['id']}", headers=admin), 200)
check(session.get(f"{api}/api_keys", headers=inference), 401)

hello = [{"role": "user", "content": "hello"}]
check(session.post(f"{api}/chat/completions", json={"model": model, "messages": hello}, headers=inference), 200)
check(session.post(f"{api}/chat/completions", json={"model": model, "messages": hello, "n": 2}, headers=inference), 200)
streamed = check(
    session.post(f"{api}/chat/completions", json={"model": model, "messages": hello, "stream": True},
                 headers=inference),
    200,
)
assert streamed.text.rstrip().endswith("data: [DONE]"), streamed.text[-200:]
check(session.post(f"{api}/chat/completions", json={"model": model, "messages": []}, headers=inference), 400,
      valid_request=False)
check(session.post(f"{api}/chat/completions", json={"model": "nope", "messages": hello}, headers=inference), 404)
check(session.post(f"{api}/chat/completions", json={"model": model, "messages": hello}), 401,
      valid_request=False)

check(session.get(f"{api}/models"), 200)
check(session.get(f"{api}/models", params={"type": "all"}), 200)
check(session.get(f"{api}/models", params={"type": "bogus"}), 400, valid_request=False)

check(session.delete(f"{api}/api_keys", params={"id": created["id"]}, headers=admin), 200)
check(session.delete(f"{api}/api_keys", params={"id": created["id"]}, headers=admin), 400)
check(session.get(f"{root}/healthz"), 200)
check(session.get(f"{root}/readyz"), 200)

print(f"conformance ok: {checked} exchanges match the document")

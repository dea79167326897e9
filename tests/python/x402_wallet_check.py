"""An independent wallet client against Rialto.

eth-account signs a Sign-In-With-Ethereum message (the EIP-4361 text is
written here, not taken from the service), and the official x402 Python SDK
pays a $5 top-up from the PAYMENT-REQUIRED header of the 402 answer. The
wallet then chats, and X-Balance-Remaining falls by the `cost`.

Environment: RIALTO_E2E_BASE_URL (…/api/v1), RIALTO_E2E_MODEL, and
RIALTO_E2E_DOMAIN (an accepted sign-in domain).
"""

import base64
import datetime
import json
import os
import secrets
from decimal import Decimal

import requests
from eth_account import Account
from eth_account.messages import encode_defunct
from x402 import x402ClientSync
from x402.http.utils import (
    decode_payment_required_header,
    decode_payment_response_header,
    encode_payment_signature_header,
)
from x402.mechanisms.evm.exact import register_exact_evm_client
from x402.mechanisms.evm.signers import EthAccountSigner

api = os.environ["RIALTO_E2E_BASE_URL"].rstrip("/")
model = os.environ["RIALTO_E2E_MODEL"]
domain = os.environ["RIALTO_E2E_DOMAIN"]
wallet = Account.create()


def sign_in_header():
    """A fresh SIWE sign-in (one per request), base64 of the structured JSON."""
    issued = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")
    nonce = secrets.token_hex(8)
    message = (
        f"{domain} wants you to sign in with your Ethereum account:\n{wallet.address}\n\n"
        f"Sign in to Rialto\n\nURI: http://{domain}\nVersion: 1\nChain ID: 8453\n"
        f"Nonce: {nonce}\nIssued At: {issued}"
    )
    signature = Account.sign_message(encode_defunct(text=message), private_key=wallet.key).signature
    payload = {
        "address": wallet.address,
        "message": message,
        "signature": "0x" + signature.hex().removeprefix("0x"),
        "chainId": 8453,
    }
    return base64.b64encode(json.dumps(payload).encode()).decode()


def chat():
    return requests.post(
        f"{api}/chat/completions",
        headers={"SIGN-IN-WITH-X": sign_in_header()},
        json={"model": model, "max_tokens": 10, "messages": [{"role": "user", "content": "hello there"}]},
        timeout=30,
    )


# Before paying: signed in, nothing to spend.
broke = chat()
assert broke.status_code == 402, broke.text
assert broke.json()["reason"] == "insufficient_balance", broke.text
print("sign-in ok")

# The SDK reads our requirements and signs an EIP-3009 authorization.
required = requests.post(f"{api}/x402/top-up", timeout=30)
assert required.status_code == 402, required.text
payment_required = decode_payment_required_header(required.headers["PAYMENT-REQUIRED"])
client = x402ClientSync()
# The SDK caps a payment at $1 unless told otherwise; a top-up is $5.
client.set_spend_controls({"max_amount_per_payment": "$10"})
register_exact_evm_client(client, EthAccountSigner(wallet))
payload = client.create_payment_payload(payment_required)
paid = requests.post(
    f"{api}/x402/top-up",
    headers={"PAYMENT-SIGNATURE": encode_payment_signature_header(payload)},
    timeout=30,
)
assert paid.status_code == 200, paid.text
settled = decode_payment_response_header(paid.headers["PAYMENT-RESPONSE"])
assert settled.success, settled
data = paid.json()["data"]
assert data["walletAddress"].lower() == wallet.address.lower(), data
assert Decimal(str(data["newBalance"])) == Decimal(5), data
print("top-up ok")

answer = chat()
assert answer.status_code == 200, answer.text
cost = Decimal(str(answer.json()["cost"]["usd"]))
assert cost > 0, answer.text
assert Decimal(answer.headers["X-Balance-Remaining"]) == Decimal(5) - cost, dict(answer.headers)
print("chat ok")

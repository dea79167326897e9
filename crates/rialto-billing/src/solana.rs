//! Local checks of an x402 `exact` payment on Solana: the client sends a
//! partially signed transaction (its own signature present, the fee payer's
//! slot empty) that transfers USDC to our associated token account. What
//! can be checked without a node is checked here, before the facilitator
//! adds the fee payer's signature and broadcasts it:
//! - the wire format (signatures, a legacy or v0 message without address
//!   lookup tables, so every account is named in the transaction);
//! - the fee payer is the one we advertise and appears in no instruction;
//! - the instructions are compute-budget (price capped), one SPL Token
//!   `TransferChecked` (mint ours, 6 decimals, destination the associated
//!   token account of our `payTo`, authority not the fee payer), and
//!   optionally memos or Lighthouse assertions, nothing else;
//! - every signature but the fee payer's verifies (Ed25519, strict) over the
//!   message bytes.
//!
//! The transfer's authority is the payer, credited after settlement.

use ed25519_dalek::{Signature, VerifyingKey};
use sha2::{Digest, Sha256};

const TOKEN_PROGRAM: &str = "TokenkegQfeZyiNwAJbNbGKPFXCWuBvf9Ss623VQ5DA";
const TOKEN_2022_PROGRAM: &str = "TokenzQdBNbLqP5VEhdkAS6EPFLC1PHnBqCXEpPxuEb";
const ASSOCIATED_TOKEN_PROGRAM: &str = "ATokenGPvbdGVxr1b2hvZbsiqW5xWH25efTNsLJA8knL";
const COMPUTE_BUDGET_PROGRAM: &str = "ComputeBudget111111111111111111111111111111";
const MEMO_PROGRAM: &str = "MemoSq4gqABAXKb96qnH8TysNcWxMyWCqXgDLGmfcHr";
const LIGHTHOUSE_PROGRAM: &str = "L2TExMFKdjpN9kozasaurPirfHy9P8sbXoAN1qA3S95";
/// The most a payment may bid per compute unit (5 lamports).
const MAX_MICROLAMPORTS_PER_CU: u64 = 5_000_000;
/// The most compute units a payment may ask for (a transfer needs ~20k):
/// the fee payer pays for them.
const MAX_COMPUTE_UNITS: u32 = 200_000;
/// Compute budget, transfer, memos or Lighthouse assertions: x402 allows 3 to 6.
const MAX_INSTRUCTIONS: usize = 6;
/// SPL Token's `TransferChecked` instruction.
const TRANSFER_CHECKED: u8 = 12;
const USDC_DECIMALS: u8 = 6;

/// What we require of a Solana payment.
#[derive(Debug, Clone)]
pub struct Rail<'a> {
    pub mint: &'a str,
    pub pay_to: &'a str,
    /// Empty: not checked (the facilitator did not tell us its key).
    pub fee_payer: &'a str,
}

/// A checked transfer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transfer {
    /// The transfer's authority (the wallet paying), base58.
    pub payer: String,
    /// Atomic units of USDC.
    pub amount: u64,
    /// SHA-256 of the message, hex: the payment's identity (a payer can
    /// sign one message in many ways).
    pub message_hash: String,
}

/// Why a Solana payment was refused (the message; the caller maps it to
/// `INVALID_PAYMENT`).
pub type Refusal = String;

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Refusal> {
        let end = self
            .at
            .checked_add(n)
            .filter(|end| *end <= self.bytes.len());
        let end = end.ok_or_else(|| "the transaction is truncated".to_owned())?;
        let taken = &self.bytes[self.at..end];
        self.at = end;
        Ok(taken)
    }

    fn byte(&mut self) -> Result<u8, Refusal> {
        Ok(self.take(1)?[0])
    }

    /// Solana's compact-u16 length, canonical only, and no larger than
    /// what `each`-byte items could fill of the rest.
    fn length(&mut self, each: usize) -> Result<usize, Refusal> {
        let malformed = || "a length in the transaction is malformed".to_owned();
        let mut value = 0usize;
        for (index, shift) in [0, 7, 14].into_iter().enumerate() {
            let byte = self.byte()?;
            // A continuation byte of zero is a non-canonical encoding.
            if index > 0 && byte == 0 {
                return Err(malformed());
            }
            value |= usize::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                if value > usize::from(u16::MAX) {
                    return Err(malformed());
                }
                if value.saturating_mul(each) > self.bytes.len() - self.at {
                    return Err("the transaction is truncated".to_owned());
                }
                return Ok(value);
            }
        }
        Err(malformed())
    }
}

struct Instruction {
    program: usize,
    accounts: Vec<usize>,
    data: Vec<u8>,
}

fn decode_key(text: &str) -> Option<[u8; 32]> {
    bs58::decode(text)
        .into_vec()
        .ok()
        .and_then(|bytes| <[u8; 32]>::try_from(bytes).ok())
}

/// The associated token account of `owner` for `mint` under `token_program`.
pub fn associated_token_account(
    owner: &[u8; 32],
    token_program: &[u8; 32],
    mint: &[u8; 32],
) -> Option<[u8; 32]> {
    let program = decode_key(ASSOCIATED_TOKEN_PROGRAM)?;
    // find_program_address: the first bump, from 255 down, whose hash is
    // not a point on the curve.
    (0..=255u8).rev().find_map(|bump| {
        let mut hasher = Sha256::new();
        for seed in [
            &owner[..],
            &token_program[..],
            &mint[..],
            &[bump][..],
            &program[..],
        ] {
            hasher.update(seed);
        }
        hasher.update(b"ProgramDerivedAddress");
        let candidate: [u8; 32] = hasher.finalize().into();
        let on_curve = curve25519_dalek::edwards::CompressedEdwardsY(candidate)
            .decompress()
            .is_some();
        (!on_curve).then_some(candidate)
    })
}

/// Checks a base64 transaction against `rail`, with `min..=max` atomic units.
pub fn check(transaction: &[u8], rail: &Rail<'_>, min: u64, max: u64) -> Result<Transfer, Refusal> {
    let mut reader = Reader {
        bytes: transaction,
        at: 0,
    };
    let signature_count = reader.length(64)?;
    let mut signatures = Vec::with_capacity(signature_count);
    for _ in 0..signature_count {
        let bytes: [u8; 64] = reader
            .take(64)?
            .try_into()
            .map_err(|_| "a signature is not 64 bytes".to_owned())?;
        signatures.push(bytes);
    }
    let message = &transaction[reader.at..];
    let mut first = reader.byte()?;
    let versioned = first & 0x80 != 0;
    if versioned {
        if first & 0x7f != 0 {
            return Err(format!(
                "transaction version {} is not supported (use v0)",
                first & 0x7f
            ));
        }
        first = reader.byte()?;
    }
    let required_signatures = usize::from(first);
    let _readonly_signed = reader.byte()?;
    let _readonly_unsigned = reader.byte()?;
    let key_count = reader.length(32)?;
    let mut keys = Vec::with_capacity(key_count);
    for _ in 0..key_count {
        let key: [u8; 32] = reader
            .take(32)?
            .try_into()
            .map_err(|_| "a key is not 32 bytes".to_owned())?;
        keys.push(key);
    }
    let _blockhash = reader.take(32)?;
    let instruction_count = reader.length(1)?;
    if instruction_count > MAX_INSTRUCTIONS {
        return Err(format!(
            "a payment holds at most {MAX_INSTRUCTIONS} instructions"
        ));
    }
    let mut instructions = Vec::with_capacity(instruction_count);
    for _ in 0..instruction_count {
        let program = usize::from(reader.byte()?);
        let account_count = reader.length(1)?;
        let accounts = reader
            .take(account_count)?
            .iter()
            .map(|i| usize::from(*i))
            .collect();
        let data_len = reader.length(1)?;
        let data = reader.take(data_len)?.to_vec();
        instructions.push(Instruction {
            program,
            accounts,
            data,
        });
    }
    if versioned && reader.length(1)? != 0 {
        return Err(
            "address lookup tables are not accepted: name every account in the transaction"
                .to_owned(),
        );
    }
    if reader.at != transaction.len() {
        return Err("the transaction has trailing bytes".to_owned());
    }
    if signatures.len() != required_signatures
        || required_signatures == 0
        || required_signatures > keys.len()
    {
        return Err("the transaction's signatures do not match its signers".to_owned());
    }
    let key = |index: usize| {
        keys.get(index).ok_or_else(|| {
            "an instruction names an account the transaction does not list".to_owned()
        })
    };
    let fee_payer = keys[0];
    if !rail.fee_payer.is_empty() && Some(fee_payer) != decode_key(rail.fee_payer) {
        return Err(format!("the fee payer must be {}", rail.fee_payer));
    }
    let program_of =
        |instruction: &Instruction| key(instruction.program).map(|k| bs58::encode(k).into_string());
    let mut transfer: Option<(&Instruction, String)> = None;
    for instruction in &instructions {
        // The fee payer must sign nothing but the fee.
        for account in &instruction.accounts {
            if *key(*account)? == fee_payer {
                return Err("the fee payer must not appear in any instruction".to_owned());
            }
        }
        let program = program_of(instruction)?;
        match program.as_str() {
            COMPUTE_BUDGET_PROGRAM => match instruction.data.first() {
                Some(2) => {
                    let units = instruction
                        .data
                        .get(1..5)
                        .filter(|_| instruction.data.len() == 5)
                        .and_then(|b| <[u8; 4]>::try_from(b).ok())
                        .map(u32::from_le_bytes)
                        .ok_or_else(|| "a compute unit limit is malformed".to_owned())?;
                    if units > MAX_COMPUTE_UNITS {
                        return Err(format!(
                            "the compute unit limit {units} is above {MAX_COMPUTE_UNITS}"
                        ));
                    }
                }
                Some(3) => {
                    if instruction.data.len() != 9 {
                        return Err("a compute unit price is malformed".to_owned());
                    }
                    let price = instruction
                        .data
                        .get(1..9)
                        .and_then(|b| <[u8; 8]>::try_from(b).ok())
                        .map(u64::from_le_bytes)
                        .ok_or_else(|| "a compute unit price is malformed".to_owned())?;
                    if price > MAX_MICROLAMPORTS_PER_CU {
                        return Err(format!(
                            "the compute unit price {price} is above {MAX_MICROLAMPORTS_PER_CU} microlamports"
                        ));
                    }
                }
                _ => {
                    return Err(
                        "only compute unit limit and price budget instructions are accepted"
                            .to_owned(),
                    );
                }
            },
            TOKEN_PROGRAM | TOKEN_2022_PROGRAM => {
                if transfer.is_some() {
                    return Err("the transaction must hold exactly one transfer".to_owned());
                }
                transfer = Some((instruction, program));
            }
            MEMO_PROGRAM | LIGHTHOUSE_PROGRAM => {}
            other => return Err(format!("program {other} is not accepted in a payment")),
        }
    }
    let Some((instruction, token_program)) = transfer else {
        return Err("the transaction holds no token transfer".to_owned());
    };
    let data = &instruction.data;
    if data.len() != 10 || data[0] != TRANSFER_CHECKED {
        return Err("the token instruction must be TransferChecked".to_owned());
    }
    let amount = u64::from_le_bytes(data[1..9].try_into().map_err(|_| "bad amount".to_owned())?);
    if data[9] != USDC_DECIMALS {
        return Err("USDC transfers have 6 decimals".to_owned());
    }
    let [source, mint, destination, authority] = instruction.accounts[..] else {
        return Err("TransferChecked must name source, mint, destination and authority".to_owned());
    };
    let _ = key(source)?;
    if Some(*key(mint)?) != decode_key(rail.mint) {
        return Err(format!("the transfer's mint must be {}", rail.mint));
    }
    let expected = match (
        decode_key(rail.pay_to),
        decode_key(&token_program),
        decode_key(rail.mint),
    ) {
        (Some(owner), Some(program), Some(mint)) => {
            associated_token_account(&owner, &program, &mint)
        }
        _ => None,
    };
    if expected.is_none() || Some(*key(destination)?) != expected {
        return Err(format!(
            "the transfer must go to {}'s USDC account",
            rail.pay_to
        ));
    }
    if authority >= required_signatures || authority == 0 {
        return Err(
            "the transfer's authority must sign the transaction, and not be the fee payer"
                .to_owned(),
        );
    }
    if amount < min || amount > max {
        return Err(format!(
            "the amount {amount} is outside {min}..={max} atomic units"
        ));
    }
    // Every signature but the fee payer's, over the message bytes.
    for (index, signature) in signatures.iter().enumerate().skip(1) {
        let verified = VerifyingKey::from_bytes(&keys[index])
            .ok()
            .is_some_and(|key| {
                key.verify_strict(message, &Signature::from_bytes(signature))
                    .is_ok()
            });
        if !verified {
            return Err("a signature of the transaction does not verify".to_owned());
        }
    }
    Ok(Transfer {
        payer: bs58::encode(keys[authority]).into_string(),
        amount,
        message_hash: hex::encode(Sha256::digest(message)),
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use ed25519_dalek::{Signer, SigningKey};

    pub const PAY_TO: &str = "9xQeWvG816bUx9EPjHmaT23yvVM2ZWbrrpZb9PusVFin";
    pub const MINT: &str = "EPjFWdd5AufqSSqeM2qN1xzybapC8G4wEGGkZwyTDt1v";

    /// Checked against solders' `Pubkey.find_program_address`.
    #[test]
    fn associated_token_accounts_are_derived_like_solana() {
        let ata = associated_token_account(
            &decode_key(PAY_TO).unwrap(),
            &decode_key(TOKEN_PROGRAM).unwrap(),
            &decode_key(MINT).unwrap(),
        )
        .unwrap();
        assert_eq!(
            bs58::encode(ata).into_string(),
            "F4YA4H7HeXLCvjLRKdh56FgE4cyHpPqLP1VCM6fEqEmX"
        );
    }

    fn compact(n: usize) -> Vec<u8> {
        assert!(n < 128);
        vec![n as u8]
    }

    /// A v0 transaction paying `amount` from `payer` to `to`'s USDC account,
    /// fee paid by `fee_payer` (unsigned), signed by the payer.
    pub fn payment(payer: &SigningKey, fee_payer: [u8; 32], to: &str, amount: u64) -> Vec<u8> {
        let owner = payer.verifying_key().to_bytes();
        let token = decode_key(TOKEN_PROGRAM).unwrap();
        let mint = decode_key(MINT).unwrap();
        let source = associated_token_account(&owner, &token, &mint).unwrap();
        let destination =
            associated_token_account(&decode_key(to).unwrap(), &token, &mint).unwrap();
        let budget = decode_key(COMPUTE_BUDGET_PROGRAM).unwrap();
        // Signers first (fee payer, payer), then writable, then read-only.
        let keys = [fee_payer, owner, source, destination, mint, token, budget];
        let mut message = vec![0x80, 2, 0, 3];
        message.extend(compact(keys.len()));
        for key in keys {
            message.extend(key);
        }
        message.extend([7u8; 32]);
        let mut limit = vec![2];
        limit.extend(20_000u32.to_le_bytes());
        let mut price = vec![3];
        price.extend(1u64.to_le_bytes());
        let mut transfer = vec![TRANSFER_CHECKED];
        transfer.extend(amount.to_le_bytes());
        transfer.push(USDC_DECIMALS);
        let instructions: [(u8, Vec<u8>, Vec<u8>); 3] = [
            (6, vec![], limit),
            (6, vec![], price),
            (5, vec![2, 4, 3, 1], transfer),
        ];
        message.extend(compact(instructions.len()));
        for (program, accounts, data) in instructions {
            message.push(program);
            message.extend(compact(accounts.len()));
            message.extend(accounts);
            message.extend(compact(data.len()));
            message.extend(data);
        }
        message.extend(compact(0));
        let mut transaction = compact(2);
        transaction.extend([0u8; 64]);
        transaction.extend(payer.sign(&message).to_bytes());
        transaction.extend(message);
        transaction
    }

    #[test]
    fn a_payment_to_us_checks_out_and_others_do_not() {
        let payer = SigningKey::from_bytes(&[9u8; 32]);
        let fee_payer = SigningKey::from_bytes(&[3u8; 32])
            .verifying_key()
            .to_bytes();
        let fee_payer_text = bs58::encode(fee_payer).into_string();
        let rail = Rail {
            mint: MINT,
            pay_to: PAY_TO,
            fee_payer: &fee_payer_text,
        };
        let good = payment(&payer, fee_payer, PAY_TO, 5_000_000);
        let transfer = check(&good, &rail, 5_000_000, 10_000_000_000).unwrap();
        assert_eq!(
            transfer.payer,
            bs58::encode(payer.verifying_key().to_bytes()).into_string()
        );
        assert_eq!(transfer.amount, 5_000_000);
        // Too little; to someone else; another fee payer; a forged signature.
        assert!(
            check(
                &payment(&payer, fee_payer, PAY_TO, 4_999_999),
                &rail,
                5_000_000,
                u64::MAX
            )
            .is_err()
        );
        let elsewhere = bs58::encode([5u8; 32]).into_string();
        let error = check(
            &payment(&payer, fee_payer, &elsewhere, 5_000_000),
            &rail,
            1,
            u64::MAX,
        )
        .unwrap_err();
        assert!(error.contains("USDC account"), "{error}");
        let other_fee = SigningKey::from_bytes(&[4u8; 32])
            .verifying_key()
            .to_bytes();
        assert!(
            check(
                &payment(&payer, other_fee, PAY_TO, 5_000_000),
                &rail,
                1,
                u64::MAX
            )
            .is_err()
        );
        let mut forged = good.clone();
        // A bit of the payer's signature (after the count and the fee
        // payer's empty slot).
        forged[1 + 64] ^= 1;
        let error = check(&forged, &rail, 1, u64::MAX).unwrap_err();
        assert!(error.contains("does not verify"), "{error}");
        assert!(check(&good[..good.len() - 3], &rail, 1, u64::MAX).is_err());
    }
}

/// Properties: no transaction bytes, however malformed, panic the checks.
#[cfg(test)]
mod properties {
    use super::tests::{MINT, PAY_TO, payment};
    use super::*;
    use ed25519_dalek::SigningKey;
    use proptest::prelude::*;

    fn rail() -> Rail<'static> {
        Rail {
            mint: MINT,
            pay_to: PAY_TO,
            fee_payer: "",
        }
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_are_refused(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            prop_assert!(check(&bytes, &rail(), 1, u64::MAX).is_err());
        }

        /// A real payment with bytes changed, cut or added: refused or, if
        /// the change missed everything that is checked, the same transfer.
        #[test]
        fn a_mangled_payment_is_refused_or_unchanged(
            edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
            cut in proptest::option::of(any::<prop::sample::Index>()),
        ) {
            let payer = SigningKey::from_bytes(&[9u8; 32]);
            let good = payment(&payer, [1u8; 32], PAY_TO, 5_000_000);
            let expected = check(&good, &rail(), 1, u64::MAX).unwrap();
            let mut bytes = good.clone();
            for (at, value) in edits {
                let i = at.index(bytes.len());
                bytes[i] = value;
            }
            if let Some(cut) = cut {
                bytes.truncate(cut.index(bytes.len()));
            }
            if let Ok(transfer) = check(&bytes, &rail(), 1, u64::MAX) {
                prop_assert_eq!(transfer.payer, expected.payer);
                prop_assert_eq!(transfer.amount, expected.amount);
            }
        }
    }
}

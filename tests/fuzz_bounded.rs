//! Bounded variants of the fuzz targets in `fuzz/` (the same bodies, `vigil::harness::fuzzing`): a few
//! thousand generated inputs per target on every test run, shaped to reach past the first
//! check (JSON-like events, expression tokens, mutated rule files, RESP replies). Long runs:
//! RELIABILITY.md, "Fuzzing".

use proptest::prelude::*;
use vigil::harness::fuzzing;

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Event-like bytes: a valid start, then JSON punctuation, digits, escapes and nesting.
fn event_like() -> impl Strategy<Value = Vec<u8>> {
    let tail = proptest::string::string_regex(r#"[{}\[\]":,0-9a-z.\\eE +-]{0,160}"#).unwrap();
    (
        prop_oneof![
            Just(r#"{"ts":1700000000000,"#),
            Just(r#"{"ts":"2023-01-01T00:00:00Z","user_id":"#),
            Just("{"),
            Just("")
        ],
        tail,
    )
        .prop_map(|(head, tail)| format!("{head}{tail}").into_bytes())
}

/// Expression-like text: the language's tokens in random order.
fn expression_like() -> impl Strategy<Value = String> {
    let token = prop_oneof![
        Just("$fails"),
        Just("$spend"),
        Just("$users-per-ip"),
        Just("@nets"),
        Just("@bad-cards"),
        Just("amount"),
        Just("geo.country"),
        Just("tags"),
        Just("`geo`"),
        Just("("),
        Just(")"),
        Just("["),
        Just("]"),
        Just(","),
        Just("&&"),
        Just("||"),
        Just("!"),
        Just("not"),
        Just("in"),
        Just("=="),
        Just("!="),
        Just("<"),
        Just(">="),
        Just("+"),
        Just("-"),
        Just("*"),
        Just("/"),
        Just("1"),
        Just("0.5"),
        Just("-3"),
        Just("1e400"),
        Just("'x'"),
        Just("\"\\u{1F600}\""),
        Just("null"),
        Just("true"),
        Just("exists("),
        Just("lower("),
        Just("matches("),
        Just("cidr("),
        Just("'10.0.0.0/8'"),
        Just("'(a'"),
        Just("starts_with("),
        Just("contains(")
    ];
    proptest::collection::vec(token, 0..24).prop_map(|tokens| tokens.join(" "))
}

proptest! {
    #![proptest_config(config(3_000))]

    #[test]
    fn event_decoding_survives_arbitrary_bytes(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        fuzzing::decode_event(&data);
    }

    #[test]
    fn event_decoding_survives_json_like_lines(data in event_like()) {
        fuzzing::decode_event(&data);
    }

    #[test]
    fn redis_reply_decoding_survives_arbitrary_bytes(data in proptest::collection::vec(any::<u8>(), 0..256)) {
        fuzzing::redis_reply(&data);
    }

    #[test]
    fn redis_reply_decoding_survives_resp_like_replies(
        items in proptest::collection::vec(
            prop_oneof![
                Just("h".to_owned()), Just("v".to_owned()), Just("=".to_owned()), Just("*".to_owned()),
                Just("o:1".to_owned()), Just("b5".to_owned()), Just("dAAAAAAAAAAAAAAAA".to_owned()),
                Just("-9223372036854775808".to_owned()), Just("9223372036854775807".to_owned()),
                Just("253402300799999".to_owned()), "[0-9-]{1,20}", "[a-z0-9:]{0,4}",
            ],
            0..16,
        ),
        nested in any::<bool>(),
    ) {
        let mut resp = format!("*{}\r\n", items.len());
        for item in &items {
            resp.push_str(&format!("${}\r\n{item}\r\n", item.len()));
        }
        if nested {
            resp = format!("*1\r\n{resp}");
        }
        fuzzing::redis_reply(resp.as_bytes());
    }
}

proptest! {
    #![proptest_config(config(600))]

    #[test]
    fn rule_compiling_survives_arbitrary_text(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        fuzzing::compile_rules(&data);
    }

    #[test]
    fn rule_compiling_survives_mutated_rule_files(cuts in proptest::collection::vec((0usize..4_000, 0usize..40, "[ -~\n]{0,6}"), 1..6)) {
        let mut text = std::fs::read_to_string("rules/payments.toml").unwrap();
        for (at, len, insert) in cuts {
            let at = at.min(text.len());
            let end = (at + len).min(text.len());
            if text.is_char_boundary(at) && text.is_char_boundary(end) {
                text.replace_range(at..end, &insert);
            }
        }
        fuzzing::compile_rules(text.as_bytes());
    }

    #[test]
    fn expressions_compile_or_fail_and_judge_without_panicking(text in expression_like()) {
        fuzzing::expression(text.as_bytes());
    }

    #[test]
    fn judging_survives_arbitrary_event_lines(lines in proptest::collection::vec(event_like(), 1..12)) {
        let mut input = Vec::new();
        for line in lines {
            input.extend_from_slice(&line);
            input.push(b'\n');
        }
        fuzzing::events(&input);
    }
}

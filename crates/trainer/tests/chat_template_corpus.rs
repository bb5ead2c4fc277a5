//! Agreement with transformers over real chat templates, opt-in: the templates TRL ships
//! (released models' and TRL's training versions) are not ours to commit, so
//! `benches/torch/dump_chat_template_corpus.py OUT.json` writes the cases locally, and
//! `HEADROOM_CHAT_TEMPLATE_CASES=OUT.json cargo test -p headroom-trainer --test
//! chat_template_corpus -- --ignored` checks that every case renders the same text and the same
//! generation spans as transformers, or fails in both.

use headroom_trainer::chat_template::{ChatRequest, ChatTemplate, ChatValue};

/// `v[key]` of an ordered JSON object (`Null` when absent).
fn get(v: &ChatValue, key: &str) -> ChatValue {
    match v {
        ChatValue::Object(o) => o
            .iter()
            .find(|(k, _)| k == key)
            .map_or(ChatValue::Null, |(_, v)| v.clone()),
        _ => panic!("{key}: not an object"),
    }
}

fn text(v: &ChatValue) -> Option<&str> {
    match v {
        ChatValue::String(s) => Some(s),
        _ => None,
    }
}

#[test]
#[ignore = "needs HEADROOM_CHAT_TEMPLATE_CASES from benches/torch/dump_chat_template_corpus.py"]
fn every_template_renders_as_transformers_renders_it() {
    let path = std::env::var("HEADROOM_CHAT_TEMPLATE_CASES")
        .expect("HEADROOM_CHAT_TEMPLATE_CASES names the cases file");
    let corpus: ChatValue = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let ChatValue::Array(cases) = get(&corpus, "cases") else {
        panic!("no cases")
    };
    let (mut rendered, mut refused, mut spans, mut continued) = (0, 0, 0, 0);
    let mut templates = std::collections::BTreeSet::new();
    let mut failures = Vec::new();
    for case in &cases {
        let name = text(&get(case, "template_name")).unwrap().to_owned();
        let what = format!("{name} {:?}", get(case, "conversation"));
        templates.insert(name.clone());
        let config = serde_json::json!({
            "chat_template": text(&get(case, "template")).unwrap(),
            "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
        });
        let ChatValue::Array(messages) = get(case, "messages") else {
            panic!("{what}: messages")
        };
        let tools = match get(case, "tools") {
            ChatValue::Array(a) => Some(a),
            _ => None,
        };
        let ChatValue::Object(extra) = get(case, "kwargs") else {
            panic!("{what}: kwargs")
        };
        // The clock the dump froze transformers' strftime_now at.
        let result = ChatTemplate::from_config(&config.to_string(), &name).and_then(|t| {
            t.unwrap()
                .with_fixed_time(1_796_029_507)
                .render_request(&ChatRequest {
                    messages: &messages,
                    add_generation_prompt: get(case, "add_generation_prompt")
                        == ChatValue::Bool(true),
                    tools: tools.as_deref(),
                    extra: &extra,
                    continue_final_message: text(&get(case, "continue_final_message")),
                    documents: None,
                })
        });
        match (result, text(&get(case, "text"))) {
            (Ok(r), Some(want)) if r.text == want => {
                rendered += 1;
                continued += usize::from(text(&get(case, "continue_final_message")).is_some());
                if let ChatValue::Array(want) = get(case, "spans") {
                    // transformers counts characters.
                    let chars = |at: usize| {
                        ChatValue::from(serde_json::json!(r.text[..at].chars().count()))
                    };
                    let got: Vec<ChatValue> = r
                        .generation
                        .iter()
                        .map(|s| ChatValue::Array(vec![chars(s.start), chars(s.end)]))
                        .collect();
                    if got == want {
                        spans += 1;
                    } else {
                        failures.push(format!("{what}: spans {got:?} vs {want:?}"));
                    }
                }
            }
            (Ok(r), Some(want)) => failures.push(format!("{what}: {:?} vs {want:?}", r.text)),
            (Err(_), None) => refused += 1,
            (Err(e), Some(_)) => failures.push(format!("{what}: {e}")),
            (Ok(_), None) => failures.push(format!("{what}: transformers raised, we rendered")),
        }
    }
    println!(
        "{} templates, {} cases: {rendered} rendered alike ({spans} with generation spans \
         alike, {continued} with the final message continued), {refused} refused by both",
        templates.len(),
        cases.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(rendered > 0 && spans > 0 && continued > 0);
}

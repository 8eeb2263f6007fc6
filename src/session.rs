//! Glue between the engine and the store: a generation becomes the turns that log it.

use crate::policy::{Generation, ModelInfo, SamplerParams, StopReason};
use crate::store::{Behavior, Features, NewTurn, TokenLogprobs};

/// The turns that record one generation: the appended prompt messages, then the reply with its
/// sampler settings, behaviour log-probs and hidden states.
pub fn turns_from_generation(
    gen: &Generation,
    params: &SamplerParams,
    info: &ModelInfo,
) -> Vec<NewTurn> {
    let template = info.template.as_str();
    let r = &gen.reply;
    let mut ctx = r.context_len - gen.prompt.iter().map(|t| t.tokens.len()).sum::<usize>();
    let mut out = Vec::with_capacity(gen.prompt.len() + 1);
    for t in &gen.prompt {
        let mut nt = NewTurn::message(
            t.message.role,
            t.message.content.clone(),
            t.tokens.clone(),
            ctx,
        );
        nt.template = Some(template.to_string());
        nt.retokenized = t.retokenized;
        ctx += t.tokens.len();
        out.push(nt);
    }
    let stop = match r.stop {
        StopReason::EndOfTurn => "end_of_turn",
        StopReason::MaxTokens => "max_tokens",
        StopReason::StopString => "stop_string",
        StopReason::Cancelled => "cancelled",
    };
    out.push(NewTurn {
        sampler: Some(params.clone()),
        behavior: Some(Behavior::Sampled),
        stop_reason: Some(stop.into()),
        adapter_id: r.adapter_id,
        template: Some(template.to_string()),
        latency_ms: Some(r.prefill_ms + r.decode_ms),
        logprobs: Some(TokenLogprobs {
            logp_behavior: r.logp_behavior.clone(),
            logp_full: r.logp_full.clone(),
            support: r.support.clone(),
        }),
        hidden: (!r.hidden.is_empty()).then(|| Features {
            n_embd: info.n_embd,
            dtype: info.feature_dtype,
            values: r.hidden.clone(),
        }),
        ..NewTurn::message(
            crate::policy::Role::Assistant,
            r.text.clone(),
            r.tokens.clone(),
            r.context_len,
        )
    });
    out
}

//! The warm start: the scripted expert's demonstrations imported and fitted (output LoRA, or a
//! block LoRA in the last blocks).

use super::*;

impl Demo<'_> {
    /// Imports the expert's demonstrations (training templates only) and fits the warm-start
    /// adapter on them; it becomes active.
    ///
    /// # Errors
    /// Engine, store and update errors.
    pub fn warm_start(&mut self, progress: &mut dyn FnMut(Progress)) -> Result<i64> {
        let t = Instant::now();
        let mut rng = Rng::new(self.cfg.seed ^ 0x5741_524d);
        progress(Progress::Phase("demonstrations", self.cfg.demos));
        let demos: Vec<Conversation> = (0..self.cfg.demos)
            .map(|_| {
                let s = restating(env::scenario(&mut rng, Split::Train), self.cfg.restate);
                expert_conversation(&s, self.cfg.patience)
            })
            .collect();
        // rescored on every engine, stored in the order they were drawn (the warm start's
        // batches follow session order)
        let rescored = on_engines(
            self.engines,
            demos,
            false,
            || Ok(()),
            |engine, (), c| rescore_conversation(engine, &c),
            &mut || progress(Progress::Tick("demonstrations")),
        )?;
        for r in &rescored {
            store_rescored(&mut self.store, r)?;
        }
        progress(Progress::Done("demonstrations"));
        self.phase("demonstrations", t);
        let t = Instant::now();
        let cfg = self.cfg.warm.clone();
        let sel = Selection {
            source: Some(Source::Import),
            since: None,
            until: None,
            limit: self.cfg.demos,
        };
        progress(Progress::Phase("warm start", 1));
        let id = match (self.cfg.block_warm, &self.cfg.rl.block) {
            // the block LoRA is the adapter RL trains: it is fitted alone, with no output LoRA
            // underneath, so that what is served is what `adapters export --format gguf`
            // carries (llama.cpp cannot attach an output LoRA to a tied output projection)
            (Some(k), Some(_)) => self.block_warm_start(None, k, progress)?,
            (block_warm, _) => {
                let r = run_update(
                    &mut self.store,
                    &self.db,
                    self.head,
                    None,
                    &cfg,
                    &sel,
                    |_, _, _| {},
                )?;
                let id = r
                    .adapter_id
                    .ok_or_else(|| Error::Invalid("the warm start wrote no adapter".into()))?;
                match block_warm {
                    Some(k) => self.block_warm_start(Some(id), k, progress)?,
                    None => id,
                }
            }
        };
        self.activate(id)?;
        self.result.warm_adapter = Some(id);
        progress(Progress::Done("warm start"));
        self.phase("warm start", t);
        Ok(id)
    }

    /// Trains a block LoRA (q,v, r = 8, last `k` blocks) on the imported demonstrations, on top
    /// of the output-LoRA warm start `parent` (fixed: the policy trained is the one served), and
    /// writes it, with `parent`'s other parts, as a new version. Without a parent it is trained
    /// on the base model's output projection and written with a zero output LoRA (`B = 0`) and
    /// a fresh value head.
    pub(super) fn block_warm_start(
        &mut self,
        parent: Option<i64>,
        k: usize,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<i64> {
        use crate::adapter::block::BlockLora;
        use crate::graph::block::BlockSpec;
        use crate::learn::block::{
            assistant_positions, capture_sequence, fit_block_sft, BlockSft, Captured, SftConfig,
        };
        use crate::policy::blocks::TailModel;
        use crate::policy::llama::{Context, ContextParams, Model};

        let t = Instant::now();
        let path = self.engines[0].info().path.clone();
        let tail = TailModel::from_gguf(&path, k)?;
        let n_embd = tail.hp.n_embd;
        let model = Model::load(&path, 0)?;
        let mut ctx = Context::new(
            &model,
            ContextParams {
                n_ctx: crate::config::DEFAULT_CTX,
                n_batch: 512,
                n_threads: self.cfg.warm.threads as i32,
                capture_hidden: false,
                capture_block: Some(tail.input_layer()),
                n_seq: 1,
                kv_cells: None,
            },
        )?;
        let sessions =
            self.store
                .training_sessions(Some(Source::Import), None, false, self.cfg.demos)?;
        let mut data = Vec::new();
        for s in &sessions {
            if let Some((tokens, scored)) = assistant_positions(&self.store, s.id)? {
                let x = capture_sequence(&mut ctx, &tokens, n_embd)?;
                let scored = scored.into_iter().filter(|&p| p < x.nrows()).collect();
                data.push(Captured {
                    tokens,
                    x,
                    scored,
                    logits: ndarray::Array2::zeros((0, 0)),
                    hidden: Vec::new(),
                });
            }
        }
        drop(ctx);
        let spec = BlockSpec {
            k,
            targets: vec!["q".into(), "v".into()],
            r: 8,
            alpha: 16.0,
        };
        let lora = BlockLora::fresh(&tail.hp, spec, self.cfg.seed);
        let batch = 4;
        let steps = (self.cfg.warm.epochs * data.len().div_ceil(batch)).min(150);
        progress(Progress::Phase("block warm start", steps));
        let adapter = match parent {
            // served on top of the parent's output LoRA: trained on top of it
            Some(parent) => Adapter::load(Path::new(&self.store.adapter(parent)?.path))?,
            None => Adapter::fresh(
                self.head.n_embd(),
                self.head.n_vocab(),
                self.cfg.warm.rank,
                self.cfg.warm.lora_alpha,
                self.cfg.seed,
                "",
            ),
        };
        let fit = fit_block_sft(
            &mut self.store,
            &self.db,
            tail,
            BlockSft {
                data: &data,
                lora,
                parent_lora: None,
                adapter,
                parent,
                sft: SftConfig {
                    steps,
                    batch,
                    lr: 2e-3,
                    seed: self.cfg.seed,
                },
                device: crate::graph::Device::Cpu,
                threads: self.cfg.warm.threads,
            },
            serde_json::json!({}),
            |_| progress(Progress::Tick("block warm start")),
        )?;
        let id = fit.id;
        progress(Progress::Done("block warm start"));
        self.phase("block warm start", t);
        Ok(id)
    }
}

//! The run itself: a new run, the RL iteration (roll out, log, annotate, update, gate,
//! activate) and the whole sequence of phases.

use super::*;

impl<'a> Demo<'a> {
    /// A run logging to `db` (a fresh file in the run directory), playing its sessions on
    /// `engines` (at least one; [`DemoConfig::engines`] is set to their number).
    ///
    /// # Errors
    /// Store errors; no engine.
    pub fn new(
        engines: &'a [Engine],
        head: &'a OutputHead,
        db: &Path,
        mut cfg: DemoConfig,
    ) -> Result<Self> {
        if engines.is_empty() {
            return Err(Error::Invalid("the demo needs at least one engine".into()));
        }
        cfg.engines = engines.len();
        let mut store = Store::open(db)?;
        store.set_policy_model(&crate::assets::model_stamp_json(&engines[0].info().path));
        let library = if cfg.experience {
            Some(Library::load(&store, LibraryConfig::default())?)
        } else {
            None
        };
        let mut rng = Rng::new(cfg.seed ^ 0x4845_4c44_4f55_5421);
        let held_out = (0..cfg.eval_scenarios)
            .map(|_| restating(env::scenario(&mut rng, Split::HeldOut), cfg.restate))
            .collect();
        Ok(Demo {
            engines,
            head,
            store,
            db: db.to_path_buf(),
            held_out,
            val_rng: Rng::new(cfg.seed ^ 0x5641_4c49_4441_5445),
            on_policy: 0,
            gate_replayed: None,
            active: None,
            library,
            start: Instant::now(),
            next_key: 1 << 40,
            result: DemoResult {
                config: cfg.clone(),
                model: engines[0].info().name.clone(),
                model_file: crate::assets::model_stamp_json(&engines[0].info().path),
                machine: Machine::this(engines, cfg.rl.threads),
                evals: Vec::new(),
                iterations: Vec::new(),
                warm_adapter: None,
                final_adapter: None,
                phase_seconds: Vec::new(),
                wall_s: 0.0,
                rl_gain: (0.0, 0.0, 0.0),
                experience_entries: Vec::new(),
                experience_injections: 0,
                peak_rss_mib: 0.0,
            },
            cfg,
        })
    }

    /// The run's store (read access for reports and tests).
    pub fn store(&self) -> &Store {
        &self.store
    }

    pub(super) fn key(&mut self) -> u64 {
        self.next_key += 1;
        self.next_key
    }

    /// Puts `adapter` on every engine.
    pub(super) fn set_adapter(&self, adapter: Option<(i64, Arc<Adapter>)>) -> Result<()> {
        for e in self.engines {
            e.set_adapter(adapter.clone())?;
        }
        Ok(())
    }

    pub(super) fn set_shadow(&self, adapter: Option<Arc<Adapter>>) -> Result<()> {
        for e in self.engines {
            e.set_shadow(adapter.clone())?;
        }
        Ok(())
    }

    pub(super) fn phase(&mut self, name: &str, t: Instant) {
        self.result
            .phase_seconds
            .push((name.to_string(), t.elapsed().as_secs_f64()));
    }

    /// One RL iteration: rollouts, annotation, update, gate, activation.
    ///
    /// # Errors
    /// Engine and store errors (a rejected update is recorded, not an error).
    pub fn iteration(&mut self, progress: &mut dyn FnMut(Progress)) -> Result<&Iteration> {
        let it = self.result.iterations.len() + 1;
        let label = format!("iteration {it}");
        let n = self.cfg.scenarios_per_iter * self.cfg.group_size;
        progress(Progress::Phase(&label, n + 2));
        let mut rng = Rng::new(
            self.cfg
                .seed
                .wrapping_mul(0x9E37_79B9)
                .wrapping_add(it as u64),
        );
        let params = SamplerParams {
            temperature: self.cfg.temperature,
            top_k: 0,
            top_p: 1.0,
            max_tokens: self.cfg.max_tokens,
            greedy_digits: self.cfg.greedy_digits,
            ..Default::default()
        };
        let sampled_with = self.active.as_ref().map(|a| a.0);
        let (mut ids, mut succ, mut rew) = (Vec::new(), 0usize, 0.0);
        // step-level credit: information gain of the ground truth with the frozen policy,
        // scored during the rollouts (the session is still in the KV cache)
        let uses_process = matches!(self.cfg.rl.algo, Algo::A2tgpo | Algo::Atpo)
            && self.cfg.process != ProcessSignal::None;
        let score_reference = uses_process && self.cfg.process == ProcessSignal::InfoGain;
        let mut jobs = Vec::with_capacity(n);
        // balanced batches: the k-th scenario takes the k-th intent of a shuffled cycle
        let order = self.cfg.stratify.then(|| env::shuffled_intents(&mut rng));
        for k in 0..self.cfg.scenarios_per_iter {
            let mut s = restating(
                match &order {
                    Some(o) => env::scenario_for(&mut rng, Split::Train, o[k % o.len()]),
                    None => env::scenario(&mut rng, Split::Train),
                },
                self.cfg.restate,
            );
            if self.cfg.paraphrase {
                env::paraphrase(&mut rng, &mut s);
            }
            for g in 0..self.cfg.group_size {
                let mut p = params.clone();
                p.seed = rng.next_u64();
                let key = self.key();
                let log = LogMeta {
                    group: format!("it{it}:s{k}"),
                    metadata: json!({"iteration": it, "intent": format!("{:?}", s.intent), "template": s.template, "rollout": g}),
                };
                let how = PlaySettings {
                    patience: self.cfg.patience,
                    params: p,
                    key,
                    score_reference,
                    ig_context: self.cfg.ig_context,
                    ig_policy: self.cfg.ig_policy,
                    id_slot: self.cfg.id_slot,
                    canonical: false,
                    adapter: None,
                };
                jobs.push(Job {
                    scenario: s.clone(),
                    how,
                    log: Some(log),
                });
            }
        }
        let mut scored = HashMap::new();
        for played in self.play_all(jobs, &label, progress)? {
            succ += usize::from(played.desk.success());
            rew += played.desk.reward();
            if let (Some(id), Some(lp)) = (played.session_id, played.reference_logp) {
                scored.insert(id, lp);
            }
            ids.extend(played.session_id);
        }
        if score_reference {
            // information gain only: the update's credit stage writes the value head's success
            // contribution (one writer per annotation)
            annotate_sessions_with(
                &mut self.store,
                &ids,
                None,
                self.active.as_ref().map(|a| a.0),
                InfoGainSource::Scored(&scored),
                &AnnotateConfig {
                    ig_context: self.cfg.ig_context,
                    ig_policy: self.cfg.ig_policy,
                    ig_space: self.cfg.ig_space,
                    ig_scorer: self.active.as_ref().map(|a| a.0),
                    ..AnnotateConfig::default()
                },
            )?;
        }
        progress(Progress::Tick(&label));
        let mut cfg = self.cfg.rl.clone();
        if cfg.objective.kl_coef > 0.0 && cfg.kl_ref_adapter.is_none() {
            cfg.kl_ref_adapter = self.result.warm_adapter;
        }
        if self.cfg.process == ProcessSignal::None {
            cfg.alpha = 0.0;
        }
        // the learner optimises the policy the rollouts were sampled from (logits / T over the
        // sampler's support), so no importance correction is needed for the temperature
        // with the validation gate, rollouts of earlier iterations whose candidates were
        // rejected were sampled with the same active adapter: still on-policy, kept
        self.on_policy = if self.cfg.val_scenarios > 0 {
            (self.on_policy + ids.len()).min(ON_POLICY_ITERATIONS * n)
        } else {
            ids.len()
        };
        let trained_on = self.on_policy;
        let sel = Selection {
            source: Some(Source::Demo),
            since: None,
            until: None,
            limit: trained_on,
        };
        let (mut update_id, mut candidate, mut activated, mut note, mut diagnostics) =
            (None, None, false, None, None);
        let mut validation = None;
        match run_update(
            &mut self.store,
            &self.db,
            self.head,
            self.active.clone(),
            &cfg,
            &sel,
            |_, _, _| {},
        ) {
            Ok(r) => {
                update_id = Some(r.update_id);
                candidate = r.adapter_id;
                let kl = r.diagnostics.approx_kl;
                diagnostics = Some(r.diagnostics);
                if let Some(id) = candidate {
                    // the KL bound first (free), then the validation comparison (played)
                    let mut v = None;
                    let verdict = gate::decide(
                        kl,
                        self.cfg.gate_kl,
                        || Ok(None),
                        || {
                            if self.cfg.val_scenarios > 0 {
                                v = Some(self.validation_gate(id)?);
                            }
                            Ok(v)
                        },
                    )?;
                    validation = v.map(|v| {
                        [
                            (v.candidate.success, v.candidate.reward),
                            (v.active.success, v.active.reward),
                        ]
                    });
                    gate::record(&self.store, id, &verdict)?;
                    if verdict.passed {
                        self.activate(id)?;
                        activated = true;
                    } else {
                        note = verdict.reason.map(|r| format!("gate: {r}"));
                    }
                }
            }
            // an iteration that cannot learn (every group equal) or whose update is rejected
            // is a result of the run, not a failure of it
            Err(Error::NothingToLearn(m)) => note = Some(m),
            Err(Error::UpdateRejected { reason, .. }) => note = Some(reason),
            Err(e) => return Err(e),
        }
        let experience = match self.library.as_mut() {
            Some(lib) => {
                let cands = Library::candidates(&self.store, &ids, 1.0)?;
                Some(lib.evolve(&mut self.store, &cands, update_id)?)
            }
            None => None,
        };
        progress(Progress::Tick(&label));
        progress(Progress::Done(&label));
        let total = n.max(1) as f64;
        self.result.iterations.push(Iteration {
            iteration: it,
            sampled_with,
            train_success: succ as f64 / total,
            train_reward: rew / total,
            sessions: ids.len(),
            update_id,
            candidate,
            activated,
            note,
            trained_on,
            validation,
            gate_replayed: validation.and(self.gate_replayed.take()),
            diagnostics,
            experience,
            elapsed_s: self.start.elapsed().as_secs_f64(),
        });
        Ok(self.result.iterations.last().expect("just pushed"))
    }

    /// The whole run within the time budget.
    ///
    /// # Errors
    /// Engine, store and update errors.
    pub fn run(mut self, progress: &mut dyn FnMut(Progress)) -> Result<DemoResult> {
        let budget = self.cfg.minutes.map_or(f64::INFINITY, |m| m * 60.0);
        if self.cfg.eval_base {
            self.evaluate("base", progress)?;
        }
        self.warm_start(progress)?;
        let t_eval = Instant::now();
        self.evaluate("warm start", progress)?;
        let eval_s = t_eval.elapsed().as_secs_f64();
        let t_rl = Instant::now();
        // the next iteration is budgeted at 1.2 × the longest so far and the final evaluation
        // at 1.25 × the warm start's: an update over kept on-policy sessions takes longer than
        // one over a single batch, and a trained policy writes longer sessions (measured on
        // seed 1 with the last iteration's time and 1.1 × the evaluation: iteration 10 took
        // 137 s against 116 s before it, the final evaluation 36 s against 31 s, 18 s over)
        let mut longest_iter_s = 0.0f64;
        loop {
            let done = self.result.iterations.len();
            if self.cfg.max_iterations.is_some_and(|m| done >= m) {
                break;
            }
            let elapsed = self.start.elapsed().as_secs_f64();
            let left = budget - elapsed - eval_s * 1.25;
            if done > 0 && left < longest_iter_s * 1.2
                || done == 0 && left <= 0.0 && self.cfg.max_iterations.is_none()
            {
                break;
            }
            let t = Instant::now();
            self.iteration(progress)?;
            longest_iter_s = longest_iter_s.max(t.elapsed().as_secs_f64());
            let it = self.result.iterations.len();
            if self.cfg.eval_every > 0
                && it.is_multiple_of(self.cfg.eval_every)
                && self.cfg.max_iterations != Some(it)
            {
                self.evaluate(&format!("iteration {it}"), progress)?;
            }
        }
        self.phase("RL iterations", t_rl);
        self.evaluate("final", progress)?;
        self.result.final_adapter = self.active.as_ref().map(|a| a.0);
        let warm = self
            .result
            .evals
            .iter()
            .find(|e| e.label == "warm start")
            .map(|e| e.success.clone())
            .unwrap_or_default();
        let fin = self
            .result
            .evals
            .last()
            .map(|e| e.success.clone())
            .unwrap_or_default();
        self.result.rl_gain = paired_bootstrap(&warm, &fin, 10_000, self.cfg.seed);
        if self.library.is_some() {
            self.result.experience_entries = Library::listing(&self.store)?;
            self.result.experience_injections = Library::injections(&self.store)?;
        }
        self.result.wall_s = self.start.elapsed().as_secs_f64();
        self.result.peak_rss_mib = peak_rss_mib();
        Ok(self.result)
    }
}

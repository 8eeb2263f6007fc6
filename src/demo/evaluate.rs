//! Greedy evaluations on the held-out set and the validation gate (the candidate and the active
//! adapter on fresh validation-template scenarios, replaying only where their choices differ).

use super::*;

impl Demo<'_> {
    /// Plays `jobs` and returns their sessions in the order of `jobs`, ticking `label` once per
    /// session ([`on_engines`]; with several engines each logs through its own connection to the
    /// run's database). Consecutive rollouts of a scenario still share their prefix on each
    /// engine.
    pub(super) fn play_all(
        &mut self,
        jobs: Vec<Job>,
        label: &str,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<Vec<Played>> {
        if jobs.len() < 2 {
            let mut out = Vec::with_capacity(jobs.len());
            for j in jobs {
                let lib = self.library.as_ref();
                out.push(play(
                    &self.engines[0],
                    &mut self.store,
                    &j.scenario,
                    &j.how,
                    j.log,
                    lib,
                )?);
                progress(Progress::Tick(label));
            }
            return Ok(out);
        }
        let (db, library) = (&self.db, self.library.as_ref());
        let one_lane = jobs.iter().any(|j| j.how.canonical);
        on_engines(
            self.engines,
            jobs,
            one_lane,
            || Store::open(db),
            |engine, store, job| play(engine, store, &job.scenario, &job.how, job.log, library),
            &mut || progress(Progress::Tick(label)),
        )
    }

    pub(super) fn activate(&mut self, id: i64) -> Result<()> {
        let (engines, previous) = (self.engines, self.active.clone());
        let on_all = |a: Option<(i64, Arc<Adapter>)>| {
            engines.iter().try_for_each(|e| e.set_adapter(a.clone()))
        };
        let ad = gate::activate(
            &mut self.store,
            id,
            |a| on_all(Some((id, a))),
            || on_all(previous),
        )?;
        self.active = Some((id, ad));
        self.on_policy = 0;
        Ok(())
    }

    /// A greedy, unlogged session of `scenario` with the engines' current adapter.
    pub(super) fn greedy_job(&mut self, scenario: &Scenario) -> Job {
        let how = PlaySettings {
            patience: self.cfg.patience,
            params: SamplerParams {
                temperature: 0.0,
                top_k: 0,
                top_p: 1.0,
                max_tokens: self.cfg.max_tokens,
                ..Default::default()
            },
            key: self.key(),
            score_reference: false,
            ig_context: self.cfg.ig_context,
            ig_policy: self.cfg.ig_policy,
            id_slot: self.cfg.id_slot,
            canonical: false,
            adapter: None,
        };
        Job {
            scenario: scenario.clone(),
            how,
            log: None,
        }
    }

    /// Greedy (success, reward, shadow agreed) of the engines' current adapter on each of
    /// `scenarios`.
    pub(super) fn validate(&mut self, scenarios: &[Scenario]) -> Result<Vec<(bool, f64, bool)>> {
        let jobs = scenarios.iter().map(|s| self.greedy_job(s)).collect();
        Ok(self
            .play_all(jobs, "validation", &mut |_| {})?
            .into_iter()
            .map(|p| {
                let agrees = p.shadow_agrees == Some(true);
                (p.desk.success(), p.desk.reward(), agrees)
            })
            .collect())
    }

    /// Greedy play of the engines' current adapter (the candidate, with the active adapter as
    /// the shadow) on each of `scenarios`, and where the shadow disagreed somewhere, the same
    /// scenario replayed with `active`'s output term (its block LoRA is the engines'), on the
    /// same lane right after.
    fn validate_with_replays(
        &mut self,
        scenarios: &[Scenario],
        active: (i64, Arc<Adapter>),
    ) -> Result<Vec<GatePlay>> {
        let jobs: Vec<(Job, Job)> = scenarios
            .iter()
            .map(|s| {
                let cand = self.greedy_job(s);
                let mut replay = self.greedy_job(s);
                replay.how.adapter = Some(active.clone());
                (cand, replay)
            })
            .collect();
        let (db, library) = (&self.db, self.library.as_ref());
        on_engines(
            self.engines,
            jobs,
            false,
            || Store::open(db),
            |engine, store, (cand, replay)| {
                let c = play(engine, store, &cand.scenario, &cand.how, None, library)?;
                let r = if c.shadow_agrees == Some(true) {
                    None
                } else {
                    let r = play(engine, store, &replay.scenario, &replay.how, None, library)?;
                    Some((r.desk.success(), r.desk.reward()))
                };
                Ok(GatePlay {
                    candidate: (c.desk.success(), c.desk.reward()),
                    active: r,
                })
            },
            &mut || {},
        )
    }

    /// The validation gate: greedy (success, reward) of the candidate and of the active adapter
    /// on the same fresh validation-template scenarios (unseen phrasings: a candidate that got
    /// better on the training phrasings and worse on new ones is measured, and rejected, as the
    /// held-out set would see it). Fresh at every gate, because an adapter
    /// that was activated for its score on a fixed set carries that set's luck with it (the
    /// winner's curse): measured, a fixed 16-scenario set rejected every later candidate. With
    /// [`DemoConfig::shadow_gate`] the active adapter plays only the scenarios where it would
    /// have chosen another token somewhere along the candidate's session (the rest are the
    /// same sessions), each right after that session on the same lane, with the active
    /// adapter's output term for its replies only ([`Engine::generate_with`]); the iteration's
    /// `gate_replayed` says how many. The engine is back on the
    /// active adapter, without a shadow, afterwards.
    pub(super) fn validation_gate(&mut self, candidate: i64) -> Result<gate::Validation> {
        let mut scenarios: Vec<Scenario> = if self.cfg.stratify {
            env::stratified(&mut self.val_rng, Split::Validation, self.cfg.val_scenarios)
        } else {
            (0..self.cfg.val_scenarios)
                .map(|_| env::scenario(&mut self.val_rng, Split::Validation))
                .collect()
        };
        for s in &mut scenarios {
            s.restates = self.cfg.restate;
        }
        let ad = Arc::new(Adapter::load(&adapter_dir(&self.db, candidate))?);
        self.set_adapter(Some((candidate, ad.clone())))?;
        // with the shadow check, the active adapter's greedy choices are checked along the
        // candidate's sessions: where it agreed at every token it would have played the same
        // session, and only the others are replayed with it
        // (only between adapters with the same block LoRA: the shadow reads the candidate's
        // hidden states, which another block LoRA would have made differently)
        let shadow = if self.cfg.shadow_gate {
            self.active
                .as_ref()
                .filter(|a| a.1.block == ad.block)
                .map(|a| a.1.clone())
        } else {
            None
        };
        let (cand, current, replayed) = match (shadow.is_some(), self.active.clone()) {
            // each scenario's replay right after its candidate session, on the same lane with
            // the active adapter for its replies only: one phase, no lane idle in between
            (true, Some(active)) => {
                let played = self
                    .set_shadow(shadow)
                    .and_then(|()| self.validate_with_replays(&scenarios, active));
                let restored = self
                    .set_shadow(None)
                    .and_then(|()| self.set_adapter(self.active.clone()));
                let played = played?;
                restored?;
                let replayed = played.iter().filter(|p| p.active.is_some()).count();
                let cand: Vec<(bool, f64)> = played.iter().map(|p| p.candidate).collect();
                let current = played
                    .iter()
                    .map(|p| p.active.unwrap_or(p.candidate))
                    .collect();
                (cand, current, replayed)
            }
            _ => {
                let cand = self.validate(&scenarios);
                let restored = self.set_adapter(self.active.clone());
                let cand: Vec<(bool, f64)> = cand?.iter().map(|c| (c.0, c.1)).collect();
                restored?;
                let current: Vec<(bool, f64)> = self
                    .validate(&scenarios)?
                    .iter()
                    .map(|r| (r.0, r.1))
                    .collect();
                (cand, current, scenarios.len())
            }
        };
        self.gate_replayed = Some((replayed, scenarios.len()));
        let mean = |v: &[(bool, f64)]| {
            let n = v.len().max(1) as f64;
            let s = v.iter().filter(|x| x.0).count() as f64;
            gate::Score {
                success: s / n,
                reward: v.iter().map(|x| x.1).sum::<f64>() / n,
            }
        };
        Ok(gate::Validation {
            candidate: mean(&cand),
            active: mean(&current),
            scenarios: scenarios.len(),
        })
    }

    /// Greedy evaluation of the current adapter on the held-out set.
    ///
    /// # Errors
    /// Engine errors.
    pub fn evaluate(&mut self, label: &str, progress: &mut dyn FnMut(Progress)) -> Result<f64> {
        let n = if label == "base" {
            self.held_out.len().min(BASE_EVAL_SCENARIOS)
        } else {
            self.held_out.len()
        };
        self.evaluate_first(label, n, progress)
    }

    pub(super) fn evaluate_first(
        &mut self,
        label: &str,
        n: usize,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<f64> {
        let t = Instant::now();
        let adapter_id = self.active.as_ref().map(|a| a.0);
        if self.library.is_none() {
            let earlier = self
                .result
                .evals
                .iter()
                .find(|e| e.adapter_id == adapter_id && e.success.len() == n && e.same_as.is_none())
                .cloned();
            if let Some(e) = earlier {
                let rate = e.rate();
                self.result.evals.push(Evaluation {
                    label: label.to_string(),
                    iteration: self.result.iterations.len(),
                    same_as: Some(e.label),
                    ..e
                });
                self.phase(&format!("evaluation: {label}"), t);
                progress(Progress::Phase(label, 0));
                progress(Progress::Done(label));
                return Ok(rate);
            }
        }
        progress(Progress::Phase(label, n));
        let mut ev = Evaluation {
            label: label.to_string(),
            iteration: self.result.iterations.len(),
            adapter_id,
            success: Vec::new(),
            reward: Vec::new(),
            mean_turns: 0.0,
            malformed_per_session: 0.0,
            transcripts: Vec::new(),
            same_as: None,
        };
        let (mut turns, mut malformed) = (0usize, 0usize);
        let scenarios: Vec<Scenario> = self.held_out.iter().take(n).cloned().collect();
        // canonical play: an evaluation's transcripts depend only on the model file, the
        // adapter, the scenario and the thread count, whatever the preset did before
        let jobs = scenarios
            .iter()
            .map(|s| {
                let mut j = self.greedy_job(s);
                j.how.canonical = true;
                j
            })
            .collect();
        for p in self.play_all(jobs, label, progress)? {
            ev.success.push(p.desk.success());
            ev.reward.push(p.desk.reward());
            turns += p.desk.agent_turns;
            malformed += p.desk.malformed;
            ev.transcripts.push(
                p.transcript
                    .iter()
                    .map(|(r, t)| (r.as_str().to_string(), t.clone()))
                    .collect(),
            );
        }
        let n = n.max(1) as f64;
        ev.mean_turns = turns as f64 / n;
        ev.malformed_per_session = malformed as f64 / n;
        let rate = ev.rate();
        self.result.evals.push(ev);
        self.phase(&format!("evaluation: {label}"), t);
        progress(Progress::Done(label));
        Ok(rate)
    }
}

/// One validation scenario of the gate: (success, reward) of the candidate's greedy session,
/// and of the active adapter's where it was replayed (`None`: it would have played the same
/// session).
pub(super) struct GatePlay {
    candidate: (bool, f64),
    active: Option<(bool, f64)>,
}

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

    /// The validation gate: greedy (success, reward) of the candidate and of the active adapter
    /// on the same fresh validation-template scenarios (unseen phrasings: a candidate that got
    /// better on the training phrasings and worse on new ones is measured, and rejected, as the
    /// held-out set would see it). Fresh at every gate, because an adapter
    /// that was activated for its score on a fixed set carries that set's luck with it (the
    /// winner's curse): measured, a fixed 16-scenario set rejected every later candidate. With
    /// [`DemoConfig::shadow_gate`] the active adapter plays only the scenarios where it would
    /// have chosen another token somewhere along the candidate's session (the rest are the
    /// same sessions); the iteration's `gate_replayed` says how many. The engine is back on the
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
        let cand = self
            .set_shadow(shadow.clone())
            .and_then(|()| self.validate(&scenarios));
        let restored = self
            .set_shadow(None)
            .and_then(|()| self.set_adapter(self.active.clone()));
        let cand = cand?;
        restored?;
        let replay: Vec<usize> = (0..scenarios.len())
            .filter(|&i| shadow.is_none() || !cand[i].2)
            .collect();
        let again: Vec<Scenario> = replay.iter().map(|&i| scenarios[i].clone()).collect();
        let mut current: Vec<(bool, f64)> = cand.iter().map(|c| (c.0, c.1)).collect();
        for (&i, r) in replay.iter().zip(self.validate(&again)?) {
            current[i] = (r.0, r.1);
        }
        self.gate_replayed = Some((replay.len(), scenarios.len()));
        let mean = |v: &[(bool, f64)]| {
            let n = v.len().max(1) as f64;
            let s = v.iter().filter(|x| x.0).count() as f64;
            gate::Score {
                success: s / n,
                reward: v.iter().map(|x| x.1).sum::<f64>() / n,
            }
        };
        Ok(gate::Validation {
            candidate: mean(&cand.iter().map(|c| (c.0, c.1)).collect::<Vec<_>>()),
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

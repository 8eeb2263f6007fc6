-- Step-level credit for people: one row per assistant turn with its latest annotations, and one
-- row per session with its outcome and the adapters that produced it.
CREATE VIEW turn_credit AS
SELECT t.session_id,
       t.idx AS turn_idx,
       t.id AS turn_id,
       t.role,
       substr(replace(t.text, char(10), ' '), 1, 60) AS snippet,
       (SELECT value FROM annotations a WHERE a.turn_id = t.id AND a.kind = 'value_before' ORDER BY a.id DESC LIMIT 1) AS value_before,
       (SELECT value FROM annotations a WHERE a.turn_id = t.id AND a.kind = 'value_after' ORDER BY a.id DESC LIMIT 1) AS value_after,
       (SELECT value FROM annotations a WHERE a.turn_id = t.id AND a.kind = 'success_contribution' ORDER BY a.id DESC LIMIT 1) AS contribution,
       (SELECT value FROM annotations a WHERE a.turn_id = t.id AND a.kind = 'info_gain' ORDER BY a.id DESC LIMIT 1) AS info_gain,
       (SELECT value FROM annotations a WHERE a.turn_id = t.id AND a.kind = 'advantage' ORDER BY a.id DESC LIMIT 1) AS advantage
FROM turns t
WHERE t.role = 'assistant';

CREATE VIEW session_summary AS
SELECT s.id AS session_id,
       s.source,
       s.group_key,
       s.outcome_reward AS outcome,
       (SELECT COUNT(*) FROM turns t WHERE t.session_id = s.id) AS turns,
       (SELECT COUNT(*) FROM turns t WHERE t.session_id = s.id AND t.role = 'assistant') AS assistant_turns,
       (SELECT group_concat(DISTINCT t.adapter_id) FROM turns t WHERE t.session_id = s.id AND t.adapter_id IS NOT NULL) AS adapter_ids,
       s.created_at,
       s.ended_at
FROM sessions s;

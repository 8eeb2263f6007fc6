//! The demo world: a small customer-service desk with verifiable outcomes, deterministic under
//! a seed — a generated back office, scenarios with a hidden intent, a rule-based customer, the
//! action syntax the agent uses, and the rewards.
//!
//! Action syntax (one line anywhere in the reply, case-insensitive, lenient about what surrounds
//! it, because the default model's base rate for exact tool syntax is near zero — docs/findings.md):
//!
//! ```text
//! ACTION status <order id>
//! ACTION refund <order id>
//! ACTION cancel <order id>
//! ACTION address <order id> <new address>
//! ACTION decline
//! ```
//!
//! An `ACTION` with an unknown verb or a missing / malformed order id is a malformed call: the
//! environment answers with an `ERROR:` observation and the format term is penalised.

use crate::policy::sampler::Rng;

/// What the customer wants (hidden from the agent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Intent {
    /// where is my order
    Status,
    /// money back for a delivered or lost order
    Refund,
    /// change the delivery address of an order not yet shipped
    AddressChange,
    /// cancel an order not yet shipped
    Cancel,
    /// a request the policy does not allow (refund of an order still being processed): decline
    OutOfPolicy,
}

impl Intent {
    /// What a customer who gives the order id says they want, in a few neutral words: no more
    /// than the opening said (a refund and an out-of-policy refund read the same; only the
    /// order's status tells them apart).
    pub fn restated(self) -> &'static str {
        match self {
            Intent::Status => "Where is it?",
            Intent::Refund | Intent::OutOfPolicy => "I'd like my money back.",
            Intent::AddressChange => "I need to change its delivery address.",
            Intent::Cancel => "Please cancel it.",
        }
    }
}

/// A parsed agent action.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// look an order up
    Status(u32),
    /// refund an order
    Refund(u32),
    /// cancel an order
    Cancel(u32),
    /// change an order's address
    Address(u32, String),
    /// decline the request
    Decline,
}

/// Order state in the back office.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OrderStatus {
    /// not shipped yet
    Processing,
    /// on its way
    Shipped,
    /// arrived
    Delivered,
    /// lost in transit
    Lost,
}

/// One order.
#[derive(Debug, Clone, PartialEq)]
pub struct Order {
    /// 5-digit id
    pub id: u32,
    /// what was bought
    pub item: &'static str,
    /// where it is
    pub status: OrderStatus,
    /// delivery address
    pub address: String,
    /// refunded
    pub refunded: bool,
    /// cancelled
    pub cancelled: bool,
}

/// A scenario: the customer, their order, their hidden intent and what they know.
#[derive(Debug, Clone, PartialEq)]
pub struct Scenario {
    /// template index (train / held-out split is by template)
    pub template: usize,
    /// the intent
    pub intent: Intent,
    /// the customer's order
    pub order: Order,
    /// the new address (address changes)
    pub new_address: String,
    /// whether the opening message already holds the order id
    pub gives_id: bool,
    /// another number in the opening message (a distractor), if any
    pub distractor: Option<u32>,
    /// the correct final action
    pub ground_truth: Action,
    /// how the customer dresses the opening message up ([`paraphrase`]); `None`: the template
    /// as it is
    pub style: Option<Style>,
    /// the customer repeats what they want when they give the order id ("It's order 89941.
    /// I'd like my money back."), as people do when an agent's question interrupts them; off:
    /// the id alone ([`Scenario::answer`])
    pub restates: bool,
}

/// Surface variation of an opening message that leaves its meaning alone: a greeting before
/// it, a closing after it, all in lower case. Applied to RL rollouts only (`turnwise demo
/// --paraphrase on`): live customers phrase the same request in many ways, and a policy that
/// trained on three templates per intent learns the templates' surface as much as the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Style {
    /// index into [`GREETINGS`]
    pub greeting: Option<usize>,
    /// index into [`CLOSINGS`]
    pub closing: Option<usize>,
    /// the whole message in lower case
    pub lowercase: bool,
}

/// Greetings a paraphrased opening may start with.
pub const GREETINGS: [&str; 5] = [
    "Hi.",
    "Hello.",
    "Good afternoon.",
    "Hey there.",
    "Sorry to bother you.",
];

/// Closings a paraphrased opening may end with.
pub const CLOSINGS: [&str; 5] = [
    "Thanks.",
    "Thank you!",
    "Thanks in advance.",
    "Please help.",
    "It's urgent.",
];

/// Gives `scenario` a random [`Style`]: a greeting with probability 1/2, a closing with
/// probability 1/2, lower case with probability 1/5 (so a fifth of the openings stay as the
/// template writes them). Nothing else about the scenario changes.
pub fn paraphrase(rng: &mut Rng, scenario: &mut Scenario) {
    let mut pick = |n: usize| {
        let r = rng.next_u64();
        r.is_multiple_of(2).then(|| ((r / 2) % n as u64) as usize)
    };
    let greeting = pick(GREETINGS.len());
    let closing = pick(CLOSINGS.len());
    let lowercase = rng.next_u64().is_multiple_of(5);
    scenario.style = Some(Style {
        greeting,
        closing,
        lowercase,
    });
}

const ITEMS: &[&str] = &[
    "blue jacket",
    "coffee grinder",
    "pair of boots",
    "desk lamp",
    "backpack",
    "phone case",
];
const STREETS: &[&str] = &[
    "12 Oak Street",
    "7 Harbour Road",
    "301 Pine Avenue",
    "58 Mill Lane",
    "9 Station Square",
];

/// Opening messages per intent: `{id}` is the order id (or removed when the customer does not
/// give it), `{item}` the item, `{n}` a distractor number. Templates 0, 2, 4 are for training
/// (demonstrations and rollouts), 1 and 3 are held out for evaluation, 5 and 6 are the
/// validation gate's ([`Split`]); every split holds a distractor template, so that unseen
/// phrasings are new but the situations (a missing id, a second number) are not.
fn openings(intent: Intent) -> &'static [&'static str] {
    match intent {
        Intent::Status => &[
            "Hi, where is my order {id}? It's a {item}.",
            "Can you check the status of order {id} please?",
            "My {item} (order {id}) hasn't arrived. Any news?",
            "Hello! I ordered a {item} {n} days ago, order {id}. Where is it?",
            "It has been {n} days since I placed order {id}. Where is it?",
            "Could you tell me where order {id} is right now?",
            "Order {id} was due {n} days ago and I still have nothing. Any update?",
        ],
        Intent::Refund => &[
            "I want a refund for order {id}, the {item} never arrived.",
            "Please refund order {id}.",
            "The {item} from order {id} is broken, I'd like my money back.",
            "I paid {n} dollars for order {id} and want a refund.",
            "Order {id} arrived with {n} scratches, please refund it.",
            "Order {id} never showed up, so I would like my money back.",
            "I was charged {n} euros for order {id}, please refund me.",
        ],
        Intent::AddressChange => &[
            "I need to change the delivery address of order {id}.",
            "Can you send order {id} to a different address?",
            "I moved! Please update the address for my {item}, order {id}.",
            "Order {id}: wrong address, I live at number {n} now.",
            "Please change the address of order {id}, I moved {n} days ago.",
            "Please ship order {id} to my new home instead.",
            "Order {id} should go to my new flat, I moved {n} weeks ago.",
        ],
        Intent::Cancel => &[
            "Please cancel order {id}.",
            "I don't need the {item} anymore, cancel order {id}.",
            "Cancel my order {id} please, I ordered it by mistake.",
            "Can order {id} still be cancelled? I bought {n} by accident.",
            "I ordered {n} of the wrong size, please cancel order {id}.",
            "I changed my mind about order {id}, please cancel it.",
            "Order {id} was a mistake, I bought {n} too many. Cancel it please.",
        ],
        Intent::OutOfPolicy => &[
            "Refund order {id} right now, I haven't even received it yet.",
            "I want my money back for order {id} before it ships.",
            "Refund {id} immediately please.",
            "Give me a refund for order {id}, I changed my mind {n} minutes ago.",
            "I want a refund for order {id} now, I ordered it {n} hours ago.",
            "Order {id} hasn't shipped yet but I want my money back already.",
            "Refund order {id}, I only ordered it {n} minutes ago.",
        ],
    }
}

/// The intents, in a fixed order.
pub const INTENTS: [Intent; 5] = [
    Intent::Status,
    Intent::Refund,
    Intent::AddressChange,
    Intent::Cancel,
    Intent::OutOfPolicy,
];

/// Which phrasings a scenario may use. The split is by opening template, so that evaluation
/// and the validation gate see phrasings no demonstration or rollout ever used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// demonstrations and RL rollouts (templates 0, 2, 4)
    Train,
    /// the held-out evaluations (templates 1, 3)
    HeldOut,
    /// the validation gate of candidate adapters (templates 5, 6): unseen phrasings, like the
    /// held-out set, without ever touching it
    Validation,
}

impl Split {
    /// The template indices of this split.
    pub fn templates(self) -> &'static [usize] {
        match self {
            Split::Train => &[0, 2, 4],
            Split::HeldOut => &[1, 3],
            Split::Validation => &[5, 6],
        }
    }

    /// The split a template index belongs to.
    pub fn of(template: usize) -> Split {
        match template {
            1 | 3 => Split::HeldOut,
            5 | 6 => Split::Validation,
            _ => Split::Train,
        }
    }
}

/// The intents in a random order (Fisher–Yates).
pub fn shuffled_intents(rng: &mut Rng) -> [Intent; 5] {
    let mut order = INTENTS;
    for i in (1..order.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
}

/// `n` scenarios whose intents are balanced: the intents in a shuffled order, repeated, so every
/// intent gets `n / 5` or one more (the rest of each scenario drawn as [`scenario`] draws it).
/// In a batch of 16 random scenarios some intent comes at most once 60 % of the time and some
/// intent six times or more 39 % of the time; a balanced batch gives every intent's decision a
/// share of each update.
pub fn stratified(rng: &mut Rng, split: Split, n: usize) -> Vec<Scenario> {
    let order = shuffled_intents(rng);
    (0..n)
        .map(|k| scenario_for(rng, split, order[k % order.len()]))
        .collect()
}

/// Draws a scenario from the templates of `split`.
pub fn scenario(rng: &mut Rng, split: Split) -> Scenario {
    let intent = INTENTS[(rng.next_u64() % INTENTS.len() as u64) as usize];
    scenario_for(rng, split, intent)
}

/// A random scenario of `intent` (everything but the intent drawn as [`scenario`] draws it).
pub fn scenario_for(rng: &mut Rng, split: Split, intent: Intent) -> Scenario {
    let templates = openings(intent);
    let choices = split.templates();
    let template = choices[(rng.next_u64() % choices.len() as u64) as usize];
    let id = 10_000 + (rng.next_u64() % 90_000) as u32;
    let status = match intent {
        Intent::Status => [
            OrderStatus::Processing,
            OrderStatus::Shipped,
            OrderStatus::Delivered,
        ][(rng.next_u64() % 3) as usize],
        Intent::Refund => {
            [OrderStatus::Delivered, OrderStatus::Lost][(rng.next_u64() % 2) as usize]
        }
        Intent::AddressChange | Intent::Cancel | Intent::OutOfPolicy => OrderStatus::Processing,
    };
    let order = Order {
        id,
        item: ITEMS[(rng.next_u64() % ITEMS.len() as u64) as usize],
        status,
        address: STREETS[(rng.next_u64() % STREETS.len() as u64) as usize].to_string(),
        refunded: false,
        cancelled: false,
    };
    // a different street from the current one
    let others: Vec<&str> = STREETS
        .iter()
        .copied()
        .filter(|s| *s != order.address)
        .collect();
    let new_address = others[(rng.next_u64() % others.len() as u64) as usize].to_string();
    let ground_truth = match intent {
        Intent::Status => Action::Status(id),
        Intent::Refund => Action::Refund(id),
        Intent::AddressChange => Action::Address(id, new_address.clone()),
        Intent::Cancel => Action::Cancel(id),
        Intent::OutOfPolicy => Action::Decline,
    };
    let gives_id = !rng.next_u64().is_multiple_of(3);
    let distractor = templates[template]
        .contains("{n}")
        .then(|| 2 + (rng.next_u64() % 60) as u32);
    Scenario {
        template,
        intent,
        order,
        new_address,
        gives_id,
        distractor,
        ground_truth,
        style: None,
        restates: true,
    }
}

impl Scenario {
    /// The customer's first message.
    pub fn opening(&self) -> String {
        let t = openings(self.intent)[self.template];
        let t = if self.gives_id {
            t.replace("{id}", &self.order.id.to_string())
        } else {
            t.replace("Order {id}", "My order")
                .replace("order {id}", "my order")
                .replace("{id}", "my order")
        };
        let t = t
            .replace("{item}", self.order.item)
            .replace("{n}", &self.distractor.unwrap_or(3).to_string());
        match self.style {
            None => t,
            Some(st) => {
                let mut parts = Vec::with_capacity(3);
                parts.extend(st.greeting.map(|g| GREETINGS[g % GREETINGS.len()]));
                parts.push(t.as_str());
                parts.extend(st.closing.map(|c| CLOSINGS[c % CLOSINGS.len()]));
                let joined = parts.join(" ");
                if st.lowercase {
                    joined.to_lowercase()
                } else {
                    joined
                }
            }
        }
    }

    /// The customer's answer to an agent reply that took no action: the order id (with the
    /// request restated, [`Scenario::restates`]) or the new address when asked for, else a
    /// nudge. Restating: measured with the id alone, 0 of 12 training rollouts of refunds
    /// without an id that asked for it were solved (seed 1): after "It's order 89941." the
    /// model looked the order up and then declined, or changed the address; asking was never
    /// rewarded, so RL could not learn to ask. An address change's customer names the order with
    /// the new address ("The new address for order 92141 is 7 Harbour Road."), in the order the
    /// action line takes them: copying an id from several messages back is beyond the
    /// output-projection adapter (measured: 0 of 136 training rollouts and 0 of 14 held-out
    /// address changes solved while the answer held the address alone; the model wrote the
    /// street number where the id goes).
    pub fn answer(&self, agent_reply: &str) -> String {
        let r = agent_reply.to_lowercase();
        // any question about the order, or an explicit request for its number
        let asks_id = ["order number", "order id", "order #", "order no"]
            .iter()
            .any(|k| r.contains(k))
            || (r.contains('?') && r.contains("order"));
        let asks_address = r.contains("address");
        if asks_address && self.intent == Intent::AddressChange {
            return format!(
                "The new address for order {} is {}.",
                self.order.id, self.new_address
            );
        }
        if asks_id {
            return if self.restates {
                format!("It's order {}. {}", self.order.id, self.intent.restated())
            } else {
                format!("It's order {}.", self.order.id)
            };
        }
        match self.intent {
            Intent::AddressChange => format!(
                "Please send order {} to {}.",
                self.order.id, self.new_address
            ),
            _ => "Can you just take care of it, please?".to_string(),
        }
    }
}

/// Parses the first `ACTION` line of a reply. `None`: no action; `Some(Err(reason))`: malformed.
pub fn parse_action(reply: &str) -> Option<Result<Action, String>> {
    // the keyword in capitals anywhere (as a word), or in any case at the start of a line
    let word_at = |i: usize| {
        let before = reply[..i].chars().next_back();
        let after = reply[i + 6..].chars().next();
        !before.is_some_and(char::is_alphanumeric) && !after.is_some_and(char::is_alphanumeric)
    };
    let caps = reply
        .match_indices("ACTION")
        .map(|(i, _)| i)
        .find(|&i| word_at(i));
    let line_start = reply
        .lines()
        .scan(0usize, |off, l| {
            let start = *off;
            *off += l.len() + 1;
            Some((start, l))
        })
        .find_map(|(start, l)| {
            let t = l.trim_start();
            let i = start + (l.len() - t.len());
            (t.len() >= 6
                && t.is_char_boundary(6)
                && t[..6].eq_ignore_ascii_case("action")
                && word_at(i))
            .then_some(i)
        });
    let at = [caps, line_start].into_iter().flatten().min()?;
    let rest = reply[at + "ACTION".len()..].lines().next().unwrap_or("");
    let mut words = rest.split_whitespace();
    let verb = words.next().map(|w| {
        w.trim_matches(|c: char| !c.is_alphanumeric())
            .to_lowercase()
    });
    let id = words
        .next()
        .map(|w| w.trim_matches(|c: char| !c.is_ascii_digit()))
        .and_then(|w| {
            w.parse::<u32>()
                .ok()
                .filter(|&n| (10_000..100_000).contains(&n))
        });
    let tail: String = words
        .collect::<Vec<_>>()
        .join(" ")
        .trim_end_matches('.')
        .to_string();
    Some(match (verb.as_deref(), id) {
        (Some("decline"), _) => Ok(Action::Decline),
        (Some("status"), Some(id)) => Ok(Action::Status(id)),
        (Some("refund"), Some(id)) => Ok(Action::Refund(id)),
        (Some("cancel"), Some(id)) => Ok(Action::Cancel(id)),
        (Some("address"), Some(id)) if !tail.is_empty() => Ok(Action::Address(id, tail)),
        (Some("address"), Some(_)) => {
            Err("ACTION address needs the new address after the order id".into())
        }
        (Some(v @ ("status" | "refund" | "cancel" | "address")), None) => {
            Err(format!("ACTION {v} needs a 5-digit order id"))
        }
        (Some(v), _) => Err(format!(
            "unknown action {v:?}; use status, refund, cancel, address or decline"
        )),
        (None, _) => Err("ACTION needs a verb".into()),
    })
}

/// The back-office result of an action, as the tool message the agent sees.
pub fn execute(order: &mut Order, action: &Action) -> String {
    let wrong = |id: u32| format!("ERROR: no order {id} for this customer");
    match action {
        Action::Status(id) if *id == order.id => format!(
            "order {id}: {:?}, {}, to {}",
            order.status, order.item, order.address
        )
        .to_lowercase(),
        Action::Refund(id) if *id == order.id => match order.status {
            OrderStatus::Delivered | OrderStatus::Lost => {
                order.refunded = true;
                format!("refund issued for order {id}")
            }
            _ => format!("ERROR: order {id} is not refundable before delivery"),
        },
        Action::Cancel(id) if *id == order.id => {
            if order.status == OrderStatus::Processing {
                order.cancelled = true;
                format!("order {id} cancelled")
            } else {
                format!("ERROR: order {id} has shipped and cannot be cancelled")
            }
        }
        Action::Address(id, a) if *id == order.id => {
            if order.status == OrderStatus::Processing {
                order.address = a.clone();
                format!("address of order {id} set to {a}")
            } else {
                format!("ERROR: order {id} has shipped")
            }
        }
        Action::Decline => "request declined".into(),
        Action::Status(id) | Action::Refund(id) | Action::Cancel(id) | Action::Address(id, _) => {
            wrong(*id)
        }
    }
}

/// Outcome reward: 1 when the final back-office state is the one the ground truth asks for
/// (and nothing else changed), else 0. A status request is solved by looking the order up; a
/// decline by declining without refunding.
pub fn outcome(s: &Scenario, final_order: &Order, actions: &[Action]) -> f64 {
    let ok = match &s.ground_truth {
        Action::Status(id) => {
            actions.contains(&Action::Status(*id))
                && !final_order.refunded
                && !final_order.cancelled
        }
        Action::Refund(_) => final_order.refunded && !final_order.cancelled,
        Action::Cancel(_) => final_order.cancelled && !final_order.refunded,
        Action::Address(_, a) => final_order.address == *a && !final_order.cancelled,
        Action::Decline => {
            actions.contains(&Action::Decline) && !final_order.refunded && !final_order.cancelled
        }
    };
    f64::from(u8::from(ok))
}

/// The numbers in `text` that have the order-id format (5 digits, 10000–99999), each once, in
/// order of first appearance: what the id slot of an action line may spell
/// ([`crate::policy::sampler::SamplerParams::id_slot`]).
pub fn order_ids_in(text: &str) -> Vec<String> {
    crate::policy::sampler::numbers_in(text)
        .into_iter()
        .filter(|n| n.len() == 5 && !n.starts_with('0'))
        .collect()
}

/// Format term: −0.1 per malformed action call.
pub fn format_penalty(malformed_calls: usize) -> f64 {
    -0.1 * malformed_calls as f64
}

/// The desk's system prompt: the action syntax and the policy rules, as the agent sees them.
pub const SYSTEM_PROMPT: &str = "You are a customer-service agent of an online shop. To act on an order, reply with one line: ACTION status <order id>, ACTION refund <order id>, ACTION cancel <order id>, ACTION address <order id> <new address>, or ACTION decline. Ask for the order number when the customer did not give it. Refunds only for delivered or lost orders; cancellations and address changes only before shipping. After the result, tell the customer briefly.";

/// What the environment answers to an agent reply.
#[derive(Debug, Clone, PartialEq)]
pub enum Observation {
    /// the customer says something
    Customer(String),
    /// the back office's result of an action (a tool message)
    Tool(String),
    /// the session is over
    End,
}

/// One session at the desk: the back-office state, the actions taken and the rewards.
#[derive(Debug, Clone)]
pub struct Desk {
    /// the scenario
    pub scenario: Scenario,
    /// the order as the back office holds it now
    pub order: Order,
    /// well-formed actions, in order
    pub actions: Vec<Action>,
    /// malformed `ACTION` lines
    pub malformed: usize,
    /// agent replies so far
    pub agent_turns: usize,
    /// the customer leaves after this many agent replies
    pub patience: usize,
    /// the agent closed the session (a reply without an action once the request was resolved)
    pub closed: bool,
    /// the last observation was a back-office result
    after_tool: bool,
}

impl Desk {
    /// A new session of `scenario`; the customer leaves after `patience` agent replies.
    pub fn new(scenario: Scenario, patience: usize) -> Self {
        Desk {
            order: scenario.order.clone(),
            scenario,
            actions: Vec::new(),
            malformed: 0,
            agent_turns: 0,
            patience,
            closed: false,
            after_tool: false,
        }
    }

    /// The back-office state is the one the customer wanted.
    pub fn resolved(&self) -> bool {
        outcome(&self.scenario, &self.order, &self.actions) > 0.0
    }

    /// Takes an agent reply and returns what the agent sees next. An `ACTION` line is executed
    /// (or answered with an `ERROR:` when malformed); a reply without one is answered by the
    /// customer, who ends the session when their request is resolved and the agent has told them
    /// (the closing reply), or when their patience runs out.
    pub fn step(&mut self, reply: &str) -> Observation {
        self.agent_turns += 1;
        let obs = match parse_action(reply) {
            Some(Err(e)) => {
                self.malformed += 1;
                Observation::Tool(format!("ERROR: {e}"))
            }
            Some(Ok(a)) => {
                let r = execute(&mut self.order, &a);
                self.actions.push(a);
                Observation::Tool(r)
            }
            None if self.after_tool && self.resolved() => {
                self.closed = true;
                Observation::End
            }
            None => Observation::Customer(self.scenario.answer(reply)),
        };
        self.after_tool = matches!(obs, Observation::Tool(_));
        if self.agent_turns >= self.patience {
            return Observation::End;
        }
        obs
    }

    /// Solved: the right final state and a closing reply.
    pub fn success(&self) -> bool {
        self.closed && self.resolved()
    }

    /// The session's reward: success (1 or 0) plus the format term.
    pub fn reward(&self) -> f64 {
        f64::from(u8::from(self.success())) + format_penalty(self.malformed)
    }
}

/// The ground truth as an action line (the reference the information gain scores).
pub fn action_line(a: &Action) -> String {
    match a {
        Action::Status(id) => format!("ACTION status {id}"),
        Action::Refund(id) => format!("ACTION refund {id}"),
        Action::Cancel(id) => format!("ACTION cancel {id}"),
        Action::Address(id, addr) => format!("ACTION address {id} {addr}"),
        Action::Decline => "ACTION decline".into(),
    }
}

/// The scripted expert agent of the warm-start demonstrations. It knows the customer's intent
/// (as a human agent reading the message would) but only the facts the conversation revealed:
/// it asks for a missing order id and a missing address, looks a refund's order up before
/// deciding between refunding and declining, and closes with a short sentence.
pub fn expert_reply(desk: &Desk, transcript: &[Observation]) -> String {
    let s = &desk.scenario;
    let id = s.order.id;
    let said = |needle: &str| {
        transcript.iter().any(|o| match o {
            Observation::Customer(t) => t.contains(needle),
            _ => false,
        }) || s.opening().contains(needle)
    };
    let knows_id = said(&id.to_string());
    let knows_address = said(&s.new_address);
    let last_tool = match transcript.last() {
        Some(Observation::Tool(t)) => Some(t.as_str()),
        _ => None,
    };
    if desk.resolved() {
        return match s.intent {
            Intent::Status => format!(
                "Your order {id} is {}.",
                format!("{:?}", desk.order.status).to_lowercase()
            ),
            Intent::Refund => format!("Your refund for order {id} has been issued."),
            Intent::Cancel => format!("Order {id} is cancelled."),
            Intent::AddressChange => {
                format!("Order {id} will now go to {}.", desk.order.address)
            }
            Intent::OutOfPolicy => {
                "Sorry, an order can only be refunded after it has been delivered.".into()
            }
        };
    }
    if !knows_id {
        return "Could you give me your order number, please?".into();
    }
    match s.intent {
        Intent::Status => action_line(&Action::Status(id)),
        Intent::Cancel => action_line(&Action::Cancel(id)),
        Intent::AddressChange if !knows_address => "What is the new delivery address?".into(),
        Intent::AddressChange => action_line(&Action::Address(id, s.new_address.clone())),
        Intent::Refund | Intent::OutOfPolicy => match last_tool {
            Some(t) if t.contains("processing") => action_line(&Action::Decline),
            Some(t) if t.starts_with("order ") => action_line(&Action::Refund(id)),
            _ => action_line(&Action::Status(id)),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_actions_leniently_and_reports_malformed_ones() {
        assert_eq!(
            parse_action("Sure!\nACTION refund 48213"),
            Some(Ok(Action::Refund(48213)))
        );
        assert_eq!(
            parse_action("I'll do it:\n  action Status #48213."),
            Some(Ok(Action::Status(48213)))
        );
        assert_eq!(
            parse_action("ACTION address 48213 7 Harbour Road."),
            Some(Ok(Action::Address(48213, "7 Harbour Road".into())))
        );
        assert_eq!(parse_action("ACTION decline"), Some(Ok(Action::Decline)));
        assert_eq!(parse_action("no action here"), None);
        assert_eq!(parse_action("TRANSACTIONS are fine"), None);
        assert!(parse_action("ACTION refund")
            .unwrap()
            .unwrap_err()
            .contains("order id"));
        assert!(
            parse_action("ACTION refund 123").unwrap().is_err(),
            "ids have 5 digits"
        );
        assert!(parse_action("ACTION teleport 48213")
            .unwrap()
            .unwrap_err()
            .contains("unknown action"));
        assert!(parse_action("ACTION address 48213").unwrap().is_err());
    }

    #[test]
    fn back_office_and_rewards() {
        let mut rng = Rng::new(3);
        let s = loop {
            let s = scenario(&mut rng, Split::Train);
            if s.intent == Intent::Refund {
                break s;
            }
        };
        let mut o = s.order.clone();
        assert!(execute(&mut o, &Action::Refund(s.order.id + 1)).starts_with("ERROR"));
        assert_eq!(outcome(&s, &o, &[]), 0.0);
        assert!(execute(&mut o, &Action::Refund(s.order.id)).contains("refund issued"));
        assert_eq!(outcome(&s, &o, &[Action::Refund(s.order.id)]), 1.0);
        assert_eq!(format_penalty(2), -0.2);
        // out of policy: a refund before delivery fails, declining succeeds
        let mut p = s.order.clone();
        p.status = OrderStatus::Processing;
        let pid = p.id;
        assert!(execute(&mut p, &Action::Refund(pid)).starts_with("ERROR"));
    }

    #[test]
    fn scenarios_are_deterministic_and_split_by_template() {
        let draw = |seed, split| {
            let mut r = Rng::new(seed);
            (0..200)
                .map(|_| scenario(&mut r, split))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(5, Split::Train), draw(5, Split::Train));
        for split in [Split::Train, Split::HeldOut, Split::Validation] {
            let d = draw(5, split);
            assert!(
                d.iter().all(|s| Split::of(s.template) == split),
                "{split:?}"
            );
            // every template of the split is used, for every intent
            for intent in INTENTS {
                for &t in split.templates() {
                    assert!(
                        d.iter().any(|s| s.intent == intent && s.template == t),
                        "{split:?} {intent:?} {t}"
                    );
                }
            }
            for s in &d {
                let open = s.opening();
                assert_eq!(open.contains(&s.order.id.to_string()), s.gives_id, "{open}");
                assert!(!open.contains('{'), "{open}");
                if let Some(n) = s.distractor {
                    assert!(open.contains(&format!(" {n} ")), "{open}");
                }
            }
        }
        // no phrasing is shared between splits
        for intent in INTENTS {
            let t = openings(intent);
            assert_eq!(t.len(), 7);
            for i in 0..t.len() {
                for j in 0..i {
                    assert_ne!(t[i], t[j]);
                }
            }
        }
        assert_eq!(
            order_ids_in("I paid 59 dollars for order 94615 (not 09461 or 946150), order 94615."),
            vec!["94615"]
        );
        let s = &draw(9, Split::Train)[0];
        assert!(s
            .answer("Could you give me your order number?")
            .contains(&s.order.id.to_string()));
        // the customer repeats the request with the id, in words that do not tell a refund from
        // an out-of-policy refund; with `restates` off, the id alone
        let d = draw(41, Split::Train);
        let ask = "Could you give me your order number, please?";
        for s in &d {
            let id = s.order.id;
            assert_eq!(
                s.answer(ask),
                format!("It's order {id}. {}", s.intent.restated())
            );
            let quiet = Scenario {
                restates: false,
                ..s.clone()
            };
            assert_eq!(quiet.answer(ask), format!("It's order {id}."));
        }
        assert_eq!(Intent::Refund.restated(), Intent::OutOfPolicy.restated());
        for i in INTENTS {
            assert!(!i.restated().contains(|c: char| c.is_ascii_digit()));
        }
        // an address change's customer names the order with the new address, id first
        let d = draw(40, Split::Train);
        let a = d
            .iter()
            .find(|s| s.intent == Intent::AddressChange)
            .expect("an address change in 200 draws");
        let id = a.order.id.to_string();
        for reply in ["What is the new delivery address?", "Okay."] {
            let ans = a.answer(reply);
            let (i, j) = (ans.find(&id), ans.find(&a.new_address));
            assert!(i.is_some() && j.is_some() && i < j, "{ans}");
        }
    }

    #[test]
    fn paraphrases_dress_the_opening_up_and_change_nothing_else() {
        let mut rng = Rng::new(17);
        let (mut greeted, mut closed, mut lower, mut plain) = (0, 0, 0, 0);
        for _ in 0..400 {
            let s = scenario(&mut rng, Split::Train);
            let mut p = s.clone();
            paraphrase(&mut rng, &mut p);
            let st = p.style.expect("a style");
            // everything but the style is the scenario's
            assert_eq!(
                Scenario {
                    style: None,
                    ..p.clone()
                },
                s
            );
            let (o, q) = (s.opening(), p.opening());
            assert!(
                q.to_lowercase().contains(&o.to_lowercase()),
                "{q:?} / {o:?}"
            );
            if let Some(g) = st.greeting {
                let g = GREETINGS[g];
                assert!(
                    q.to_lowercase()
                        .starts_with(&format!("{} ", g.to_lowercase())),
                    "{q}"
                );
                greeted += 1;
            }
            if let Some(c) = st.closing {
                assert!(
                    q.to_lowercase()
                        .ends_with(&format!(" {}", CLOSINGS[c].to_lowercase())),
                    "{q}"
                );
                closed += 1;
            }
            if st.lowercase {
                assert_eq!(q, q.to_lowercase());
                lower += 1;
            }
            if q == o {
                plain += 1;
            }
            // the customer still answers with the id, and the ids the slot may write are the same
            assert_eq!(
                p.answer("What is your order number?"),
                s.answer("What is your order number?")
            );
            assert_eq!(order_ids_in(&q), order_ids_in(&o));
        }
        // about 1/2, 1/2, 1/5 and 1/5 of 400
        for (n, lo, hi) in [
            (greeted, 160, 240),
            (closed, 160, 240),
            (lower, 50, 110),
            (plain, 50, 110),
        ] {
            assert!((lo..=hi).contains(&n), "{greeted} {closed} {lower} {plain}");
        }
        // deterministic under the seed
        let draw = |seed| {
            let mut r = Rng::new(seed);
            let mut s = scenario(&mut r, Split::Train);
            paraphrase(&mut r, &mut s);
            s.opening()
        };
        assert_eq!(draw(5), draw(5));
    }

    #[test]
    fn stratified_batches_balance_the_intents() {
        let mut rng = Rng::new(7);
        for n in [1usize, 5, 16, 32] {
            let b = stratified(&mut rng, Split::Validation, n);
            assert_eq!(b.len(), n);
            for intent in INTENTS {
                let k = b.iter().filter(|s| s.intent == intent).count();
                assert!(k == n / 5 || k == n / 5 + 1, "{n}: {intent:?} {k}");
            }
            assert!(b.iter().all(|s| Split::of(s.template) == Split::Validation));
            // each scenario's ground truth follows its intent
            for s in &b {
                assert_eq!(
                    s.ground_truth == Action::Decline,
                    s.intent == Intent::OutOfPolicy
                );
            }
        }
        // the order is shuffled per batch, not fixed
        let mut rng = Rng::new(1);
        let starts: Vec<Intent> = (0..20)
            .map(|_| stratified(&mut rng, Split::Train, 5)[0].intent)
            .collect();
        assert!(
            INTENTS.iter().filter(|i| starts.contains(i)).count() >= 3,
            "{starts:?}"
        );
        // `scenario` draws the intent and then exactly what `scenario_for` draws
        let (mut a, mut b) = (Rng::new(3), Rng::new(3));
        let s = scenario(&mut a, Split::HeldOut);
        b.next_u64();
        let t = scenario_for(&mut b, Split::HeldOut, s.intent);
        assert_eq!(
            (s.order.id, s.template, s.opening()),
            (t.order.id, t.template, t.opening())
        );
    }
}

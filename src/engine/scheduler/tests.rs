//! The scheduler's unit tests.

use super::*;

fn sched(num_blocks: usize, max_seqs: usize, budget: usize) -> Scheduler {
    Scheduler::new(
        SchedulerConfig {
            max_num_seqs: max_seqs,
            max_num_batched_tokens: budget,
        },
        BlockManager::new(num_blocks, 4, true),
    )
}

fn add(s: &mut Scheduler, id: u64, prompt: Vec<u32>) {
    let t = s.blocks().new_table();
    s.add(Sequence::new(SeqId(id), prompt, t, None));
}

/// Run a plan as the engine would: commit, then append a sampled token where logits came back.
fn step(s: &mut Scheduler) -> Plan {
    let p = s.schedule();
    s.commit(&p);
    for c in &p.chunks {
        if c.wants_logits {
            s.get_mut(c.seq).unwrap().tokens.push(7);
        }
    }
    p
}

fn chunk(seq: u64, start: usize, len: usize, wants_logits: bool) -> Chunk {
    Chunk {
        seq: SeqId(seq),
        start,
        len,
        wants_logits,
    }
}

#[test]
fn long_prompts_are_chunked_and_decodes_go_first() {
    let mut s = sched(64, 8, 8);
    add(&mut s, 1, vec![1; 3]);
    let p = step(&mut s);
    assert_eq!(p.chunks, vec![chunk(1, 0, 3, true)]);
    assert_eq!(p.admitted, vec![SeqId(1)]);
    add(&mut s, 2, vec![2; 20]);
    // Seq 1 decodes (1 token), seq 2 takes the remaining 7 of the budget.
    let p = step(&mut s);
    assert_eq!(p.chunks, vec![chunk(1, 3, 1, true), chunk(2, 0, 7, false)]);
    let p = step(&mut s);
    assert_eq!(p.chunks, vec![chunk(1, 4, 1, true), chunk(2, 7, 7, false)]);
    let p = step(&mut s);
    assert_eq!(p.chunks, vec![chunk(1, 5, 1, true), chunk(2, 14, 6, true)]);
    let p = step(&mut s);
    assert_eq!(p.chunks, vec![chunk(1, 6, 1, true), chunk(2, 20, 1, true)]);
    assert!(p.admitted.is_empty());
}

#[test]
fn sequence_limit_and_fcfs_admission() {
    let mut s = sched(64, 2, 100);
    for id in 1..=3 {
        add(&mut s, id, vec![id as u32; 5]);
    }
    let p = step(&mut s);
    assert_eq!(p.admitted, vec![SeqId(1), SeqId(2)]);
    assert_eq!((s.num_running(), s.num_waiting()), (2, 1));
    drop(s.remove(SeqId(1)));
    let p = step(&mut s);
    assert_eq!(p.admitted, vec![SeqId(3)]);
    assert_eq!(p.chunks[0], chunk(2, 5, 1, true));
}

#[test]
fn out_of_blocks_preempts_the_newest_and_recomputes_it_later() {
    // 4 blocks of 4 tokens: two sequences of 7 prompt tokens fit (2 blocks each) until the
    // first needs a third block.
    let mut s = sched(4, 4, 100);
    add(&mut s, 1, vec![1; 7]);
    add(&mut s, 2, vec![2; 7]);
    step(&mut s); // both prefilled, 8 tokens each now
    step(&mut s); // both decode position 7, 9 tokens each now
    assert_eq!(s.blocks().num_free(), 0);
    let p = step(&mut s);
    // Seq 1 needs a third block for position 8: seq 2 is preempted.
    assert_eq!(p.preempted, vec![SeqId(2)]);
    assert_eq!(p.chunks, vec![chunk(1, 8, 1, true)]);
    assert_eq!(s.get(SeqId(2)).unwrap().num_computed, 0);
    assert_eq!(s.get(SeqId(2)).unwrap().num_preemptions, 1);
    assert_eq!(
        s.get(SeqId(2)).unwrap().tokens.len(),
        9,
        "generated tokens kept"
    );
    // When seq 1 ends, seq 2 comes back and recomputes its 9 tokens, sampling the 10th.
    drop(s.remove(SeqId(1)));
    assert_eq!(s.blocks().num_free(), 4);
    let p = step(&mut s);
    assert_eq!(p.chunks.len(), 1);
    let c = p.chunks[0];
    assert_eq!(
        (c.seq, c.start + c.len, c.wants_logits),
        (SeqId(2), 9, true)
    );
    // Its first block survived in the prefix cache (tail blocks are evicted first).
    assert_eq!(c.start, 4);
}

#[test]
fn a_lone_sequence_that_cannot_grow_preempts_itself() {
    let mut s = sched(2, 4, 100);
    add(&mut s, 1, vec![1; 8]);
    step(&mut s);
    let p = step(&mut s);
    assert_eq!(p.preempted, vec![SeqId(1)]);
    assert!(p.chunks.is_empty());
}

#[test]
fn prefix_cache_skips_shared_prompt_blocks() {
    let mut s = sched(16, 4, 100);
    add(&mut s, 1, (0..10).collect());
    step(&mut s);
    add(&mut s, 2, (0..12).collect());
    let p = step(&mut s);
    assert_eq!(p.chunks[1], chunk(2, 8, 4, true));
    assert_eq!(s.blocks().stats().num_prefix_hit_tokens, 8);
}

/// A sequence whose K/V hold several adapter versions' (a switch kept them) offers no block
/// to the prefix cache: a later prompt of the same tokens computes its own.
#[test]
fn mixed_kv_blocks_are_never_shared() {
    let mut s = sched(16, 4, 100);
    add(&mut s, 1, (0..10).collect());
    s.get_mut(SeqId(1)).unwrap().mixed_kv = true;
    step(&mut s);
    add(&mut s, 2, (0..12).collect());
    let p = step(&mut s);
    assert_eq!(p.chunks[1], chunk(2, 0, 12, true));
    assert_eq!(s.blocks().stats().num_prefix_hit_tokens, 0);
}

#[test]
fn admission_waits_for_blocks_without_holding_any() {
    let mut s = sched(3, 4, 100);
    add(&mut s, 1, vec![1; 12]);
    step(&mut s);
    add(&mut s, 2, vec![2; 5]);
    let p = step(&mut s);
    // Seq 1 needs a 4th block for position 12: none; it preempts itself, and cannot come back
    // yet. Seq 2 waits behind it (first come, first served), and the cached blocks seq 1
    // matched on the way are not held while it waits.
    assert_eq!(p.preempted, vec![SeqId(1)]);
    assert!(p.admitted.is_empty() && p.chunks.is_empty());
    assert_eq!(s.blocks().num_free(), 3);
    assert_eq!(s.num_waiting(), 2);
}

fn add_for(s: &mut Scheduler, id: u64, client: u64, prompt: Vec<u32>) {
    let t = s.blocks().new_table();
    let mut q = Sequence::new(SeqId(id), prompt, t, None);
    q.client = ClientId(client);
    s.add(q);
}

fn running_of(s: &Scheduler, client: u64) -> usize {
    s.running
        .iter()
        .filter(|q| q.client == ClientId(client))
        .count()
}

/// One client's sequences fill every slot; another client's sequence arriving later is
/// admitted at the next step, in place of the first client's newest (preempted, first in line
/// again), and the first client's waiting sequences do not jump ahead of it.
#[test]
fn a_client_running_none_takes_a_slot_from_a_client_running_many() {
    let mut s = sched(64, 4, 64);
    for id in 1..=6 {
        add_for(&mut s, id, 1, vec![1, 2, 3]);
    }
    step(&mut s);
    assert_eq!(running_of(&s, 1), 4);
    add_for(&mut s, 10, 2, vec![4, 5, 6]);
    let p = step(&mut s);
    assert_eq!(p.admitted, vec![SeqId(10)]);
    assert_eq!(p.preempted, vec![SeqId(4)]);
    assert_eq!((running_of(&s, 1), running_of(&s, 2)), (3, 1));
    // Client 1 still runs two more: a second sequence of client 2 takes another slot.
    add_for(&mut s, 11, 2, vec![7, 8, 9]);
    let p = step(&mut s);
    assert_eq!((p.admitted, p.preempted), (vec![SeqId(11)], vec![SeqId(3)]));
    // Balanced now (2 and 2): a third of client 2 waits its turn.
    add_for(&mut s, 12, 2, vec![7, 8, 9]);
    let p = step(&mut s);
    assert!(p.preempted.is_empty() && p.admitted.is_empty(), "{p:?}");
    // A client alone is never preempted for fairness.
    let mut s = sched(64, 2, 64);
    for id in 1..=3 {
        add_for(&mut s, id, 1, vec![1, 2, 3]);
    }
    for _ in 0..3 {
        assert!(step(&mut s).preempted.is_empty());
    }
}

/// Blocks, not slots, are what one client holds: the other client's prompt is admitted by
/// preempting the heavy client's newest, and when a decode needs a block the heavy client's
/// newest goes, never the light client's one sequence.
#[test]
fn blocks_are_shared_fairly_between_clients() {
    // 8 blocks of 4 tokens; client 1's three sequences of 8 tokens take 6.
    let mut s = sched(8, 8, 64);
    for id in 1..=3 {
        add_for(&mut s, id, 1, (0..8).collect());
    }
    step(&mut s);
    assert_eq!(s.blocks().num_free(), 2);
    add_for(&mut s, 10, 2, (100..111).collect());
    let p = step(&mut s);
    assert!(p.admitted.contains(&SeqId(10)), "{p:?}");
    assert!(p.preempted.contains(&SeqId(3)), "{p:?}");
    // Decode until blocks run out: client 2's one sequence goes only once client 1 runs no
    // more than it does.
    let mut seen = false;
    for _ in 0..12 {
        let before = (running_of(&s, 1), running_of(&s, 2));
        let p = step(&mut s);
        seen |= !p.preempted.is_empty();
        if p.preempted.contains(&SeqId(10)) {
            assert!(before.0 <= before.1, "{before:?} {p:?}");
        }
    }
    assert!(seen, "blocks never ran out");
}

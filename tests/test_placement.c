/* Placement policies and the simulator (engine/placement): every policy's map is valid for many
 * device counts and replica budgets (every expert reachable, shares summing to one, no expert
 * twice on a device, slots respected); eplb reaches imbalance <= 1.05 on a skewed load with one
 * replica per device, predicted and measured on held-out synthetic routing; c2r cuts the tokens
 * sent off-device by >= 20% against contiguous at 8 devices on routing with planted
 * collaborating experts, within 1.10 imbalance; hierarchical eplb keeps every replica's rows on
 * its expert's node and cuts (token, node) pairs on held-out clusters; plc_pick follows the
 * shares; impossible
 * placements are refused naming the flag; the simulator runs the committed trace of the
 * bundled model and refuses a corrupt one with its offset. */
#include <math.h>
#include <stdio.h>
#include <unistd.h>

#include "common.h"
#include "placement/placement.h"
#include "placement/placement_sim.h"
#include "routing/route_stats.h"
#include "routing/route_synth.h"
#include "routing/route_trace.h"
#include "test.h"

/* Checks a map against the rules plc_map_finish does not (it checked the rest when it was
 * built): the slot cap and the index. */
static void check_map(const struct plc_map *m, int slots, const char *what)
{
    int E = m->n_expert, N = m->n_dev, S = m->n_slots;
    bool ok = true;
    for (int l = 0; l < m->n_layer; l++) {
        const int *off = m->rep_off + (size_t)l * (E + 1);
        for (int x = 0; x < E; x++) {
            double sum = 0.0;
            ok &= off[x + 1] > off[x];
            for (int i = off[x]; i < off[x + 1]; i++) {
                int s = m->rep_slot[(size_t)l * S + i];
                ok &= m->slot_expert[(size_t)l * S + s] == x;
                sum += m->slot_share[(size_t)l * S + s];
            }
            ok &= fabs(sum - 1.0) < 1e-5;
            ok &= m->rep_cum[(size_t)l * S + off[x + 1] - 1] == 1.0f;
        }
        for (int d = 0; d < N; d++) ok &= plc_device_slots(m, l, d) <= slots;
        /* dev_order lists every slot once, devices in order */
        int prev = -1;
        for (int i = 0; i < S; i++) {
            int dv = m->slot_dev[(size_t)l * S + m->dev_order[(size_t)l * S + i]];
            ok &= dv >= prev;
            prev = dv;
        }
    }
    CHECKF(ok, "%s: invalid map", what);
}

/* Zipf-skewed per-expert loads over layers, and a co-activation matrix from synthetic routing. */
struct fixture {
    struct plc_model md;
    int widths[64], groups[64];
    double flops[4 * 64];
    float coact[4 * 64 * 64];
};

static void make_fixture(struct fixture *f, int E, int L)
{
    char err[MS_ERR_LEN];
    memset(f, 0, sizeof *f);
    f->md = (struct plc_model){.n_layer = L, .n_expert = E, .top_k = 4, .d_model = 64,
                               .expert_width = f->widths, .n_group = 4,
                               .expert_group = f->groups};
    struct rsynth_config c = {.n_layer = L, .n_expert = E, .top_k = 4, .d_model = 64,
                              .width = 256, .groups = 4, .cluster = 8, .p_in = 0.8,
                              .topic_skew = 1.0, .expert_skew = 0.8, .seed = 3};
    struct rsynth *sy = NULL;
    struct rstats *st = NULL;
    struct rstats_config rc = {.n_layer = L, .n_expert = E, .top_k = 4, .d_model = 64,
                               .coact = true};
    if (rsynth_create(&c, &sy, err, sizeof err) != 0) return;
    memcpy(f->widths, rsynth_widths(sy), sizeof(int) * (size_t)E);
    memcpy(f->groups, rsynth_groups(sy), sizeof(int) * (size_t)E);
    rc.expert_width = f->widths;
    if (rstats_create(&rc, &st, err, sizeof err) == 0) {
        static int32_t ids[4 * 512 * 4];
        for (int s = 0; s < 16; s++) {
            rsynth_step(sy, 512, ids, NULL);
            rstats_add(st, ids, 512, 0);
        }
        for (int l = 0; l < L; l++) {
            rstats_expert_flops(st, l, f->flops + (size_t)l * E);
            rstats_coact(st, l, f->coact + (size_t)l * E * E);
        }
    }
    rstats_free(st);
    rsynth_free(sy);
}

static double predicted_imbalance(const struct plc_map *m, const double *flops)
{
    double worst = 0.0, dl[256];
    for (int l = 0; l < m->n_layer; l++) {
        plc_device_load(m, l, flops + (size_t)l * m->n_expert, dl);
        double mx = 0.0, tot = 0.0;
        for (int d = 0; d < m->n_dev; d++) {
            mx = dl[d] > mx ? dl[d] : mx;
            tot += dl[d];
        }
        double r = mx / (tot / m->n_dev);
        worst = r > worst ? r : worst;
    }
    return worst;
}

static void test_valid_maps(void)
{
    static struct fixture f;
    make_fixture(&f, 64, 4);
    struct plc_stats st = {.flops = f.flops, .coact = f.coact};
    const int devs[] = {1, 2, 3, 4, 8, 16, 64, 256};
    char err[MS_ERR_LEN], what[128];
    for (int p = 0; p < PLC_N_POLICIES; p++)
        for (size_t i = 0; i < sizeof devs / sizeof *devs; i++)
            for (int rk = 0; rk < 3; rk++) {
                int N = devs[i], R = rk == 0 ? 0 : rk == 1 ? N : 3 * N + 1;
                if ((long)R > 64L * (N - 1)) R = 64 * (N - 1);
                struct plc_params pp = {.policy = (enum plc_policy)p, .n_dev = N, .redundant = R};
                struct plc_map m;
                snprintf(what, sizeof what, "%s N=%d R=%d", plc_policy_name(pp.policy), N, R);
                int rc = plc_compute(&f.md, &pp, &st, &m, err, sizeof err);
                CHECKF(rc == 0, "%s: %s", what, err);
                if (rc) continue;
                CHECK(m.n_slots == 64 + R && m.n_dev == N && m.n_layer == 4);
                check_map(&m, (64 + R + N - 1) / N, what);
                /* eplb with a replica per device balances its own statistics */
                if (R >= N && N > 1 && pp.policy == PLC_POLICY_EPLB)
                    CHECKF(predicted_imbalance(&m, f.flops) < 1.05, "%s: imbalance %.3f", what,
                           predicted_imbalance(&m, f.flops));
                struct plc_map copy;
                CHECK(plc_map_copy(&copy, &m) == 0 && plc_map_moves(&copy, &m) == 0);
                plc_map_free(&copy);
                plc_map_free(&m);
            }
    /* mohge here equals the engine's All-size Group-decoupling rule in every layer. */
    struct plc_params pp = {.policy = PLC_POLICY_MOHGE, .n_dev = 4};
    struct plc_map m;
    if (plc_compute(&f.md, &pp, &st, &m, err, sizeof err) == 0) {
        int owner[64];
        plc_mohge_owner(64, 4, 4, owner);
        bool same = true;
        for (int l = 0; l < 4; l++)
            for (int x = 0; x < 64; x++) {
                int s = m.rep_slot[(size_t)l * m.n_slots + m.rep_off[(size_t)l * 65 + x]];
                same &= m.slot_dev[(size_t)l * m.n_slots + s] == owner[x];
            }
        CHECK(same);
        plc_map_free(&m);
    }
}

static void test_eplb_balance(void)
{
    /* A skewed load: Zipf(1.2) over 64 experts, the hottest ~20x the median; 8 devices, one
     * replica per device (R = 8). */
    int widths[64];
    double flops[64];
    for (int x = 0; x < 64; x++) {
        widths[x] = 128;
        flops[(x * 37) % 64] = 1e6 * pow(x + 1.0, -1.2);
    }
    struct plc_model md = {.n_layer = 1, .n_expert = 64, .top_k = 4, .d_model = 64,
                           .expert_width = widths};
    struct plc_stats st = {.flops = flops};
    char err[MS_ERR_LEN];
    for (int N = 2; N <= 64; N *= 2) {
        struct plc_params pp = {.policy = PLC_POLICY_EPLB, .n_dev = N, .redundant = N};
        struct plc_map m;
        int rc = plc_compute(&md, &pp, &st, &m, err, sizeof err);
        CHECKF(rc == 0, "%s", err);
        if (rc) continue;
        double imb = predicted_imbalance(&m, flops);
        CHECKF(imb <= 1.05, "eplb N=%d R=%d: predicted imbalance %.4f", N, N, imb);
        /* contiguous, for comparison, is far off on this load */
        struct plc_params pc = {.policy = PLC_POLICY_CONTIGUOUS, .n_dev = N};
        struct plc_map c;
        if (plc_compute(&md, &pc, &st, &c, err, sizeof err) == 0) {
            CHECK(predicted_imbalance(&c, flops) > 1.2);
            plc_map_free(&c);
        }
        plc_map_free(&m);
    }
}

/* Hierarchical eplb (n_nodes): every replica of an expert on one node, the map valid, each node
 * balanced within itself and the whole within 1.10 on a planted-cluster load with a replica per
 * device; with co-activation counts, fewer (token, node) pairs than flat eplb on routing from
 * the same distribution; refusals for a count that does not divide the devices and for other
 * policies. */
static void test_eplb_nodes(void)
{
    static struct fixture f;
    make_fixture(&f, 64, 4);
    struct plc_stats st = {.flops = f.flops, .coact = f.coact};
    char err[MS_ERR_LEN], what[64];
    const int cfg[][2] = {{4, 2}, {8, 2}, {8, 4}, {16, 4}, {64, 8}};
    for (size_t c = 0; c < sizeof cfg / sizeof *cfg; c++) {
        int N = cfg[c][0], M = cfg[c][1], D = N / M;
        struct plc_params pp = {.policy = PLC_POLICY_EPLB, .n_dev = N, .redundant = N,
                                .n_nodes = M};
        struct plc_map m;
        snprintf(what, sizeof what, "eplb N=%d nodes=%d", N, M);
        int rc = plc_compute(&f.md, &pp, &st, &m, err, sizeof err);
        CHECKF(rc == 0, "%s: %s", what, err);
        if (rc) continue;
        check_map(&m, (64 + N + N - 1) / N, what);
        int spread = 0;
        for (int l = 0; l < 4; l++)
            for (int x = 0; x < 64; x++) {
                const int *off = m.rep_off + (size_t)l * 65;
                const int *slot = m.rep_slot + (size_t)l * m.n_slots;
                int node0 = m.slot_dev[(size_t)l * m.n_slots + slot[off[x]]] / D;
                for (int i = off[x]; i < off[x + 1]; i++)
                    if (m.slot_share[(size_t)l * m.n_slots + slot[i]] > 0 &&
                        m.slot_dev[(size_t)l * m.n_slots + slot[i]] / D != node0)
                        spread++;
            }
        CHECKF(spread == 0, "%s: %d replicas with rows on another node", what, spread);
        double imb = predicted_imbalance(&m, f.flops);
        CHECKF(imb < 1.10, "%s: predicted imbalance %.3f", what, imb);
        plc_map_free(&m);
    }
    /* the (token, node) pairs on held-out routing: the fixture's generator past the 16 steps
     * its statistics came from */
    struct rsynth_config sc = {.n_layer = 4, .n_expert = 64, .top_k = 4, .d_model = 64,
                               .width = 256, .groups = 4, .cluster = 8, .p_in = 0.8,
                               .topic_skew = 1.0, .expert_skew = 0.8, .seed = 3};
    struct rsynth *sy = NULL;
    double sends[2] = {0, 0};
    if (rsynth_create(&sc, &sy, err, sizeof err) == 0) {
        static int32_t ids[4 * 512 * 4];
        for (int k = 0; k < 16; k++) rsynth_step(sy, 512, ids, NULL);
        for (int h = 0; h < 2; h++) {
            struct plc_params pp = {.policy = PLC_POLICY_EPLB, .n_dev = 8, .redundant = 8,
                                    .n_nodes = h ? 4 : 0};
            struct plc_map m;
            struct psim *s = NULL;
            struct psim_config c = {.batch_tokens = 512, .act_bytes = 2, .weight_bytes = 2,
                                    .nodes = 4};
            if (plc_compute(&f.md, &pp, &st, &m, err, sizeof err) != 0 ||
                psim_create(&f.md, &m, &c, &s, err, sizeof err) != 0) {
                CHECKF(0, "%s", err);
                continue;
            }
            for (int k = 0; k < 8; k++) {
                rsynth_step(sy, 512, ids, NULL);
                psim_feed(s, ids, 512, 0);
            }
            struct psim_result r;
            psim_result(s, &r);
            sends[h] = r.cross_node_sends;
            psim_free(s);
            plc_map_free(&m);
        }
        rsynth_free(sy);
    }
    printf("(token, other node) pairs per row, 8 devices in 4 nodes: flat eplb %.3f, "
           "over the nodes %.3f\n", sends[0], sends[1]);
    CHECKF(sends[1] < 0.9 * sends[0], "node sends: flat %.3f, hierarchical %.3f", sends[0],
           sends[1]);
    struct plc_map m;
    struct plc_params bad = {.policy = PLC_POLICY_EPLB, .n_dev = 6, .n_nodes = 4};
    CHECK(plc_compute(&f.md, &bad, &st, &m, err, sizeof err) != 0 && strstr(err, "divide"));
    bad = (struct plc_params){.policy = PLC_POLICY_C2R, .n_dev = 8, .n_nodes = 2};
    CHECK(plc_compute(&f.md, &bad, &st, &m, err, sizeof err) != 0 && strstr(err, "eplb"));
}

static void test_pick(void)
{
    int widths[2] = {8, 8};
    double flops[2] = {3.0, 1.0};
    struct plc_model md = {.n_layer = 1, .n_expert = 2, .top_k = 1, .d_model = 8,
                           .expert_width = widths};
    struct plc_stats st = {.flops = flops};
    struct plc_params pp = {.policy = PLC_POLICY_EPLB, .n_dev = 4, .redundant = 2};
    struct plc_map m;
    char err[MS_ERR_LEN];
    int rc = plc_compute(&md, &pp, &st, &m, err, sizeof err);
    CHECKF(rc == 0, "%s", err);
    if (rc) return;
    /* Every device gets load 1: expert 0 over three devices, expert 1 on the fourth. */
    CHECK(fabs(predicted_imbalance(&m, flops) - 1.0) < 1e-6);
    int hits[16] = {0};
    for (uint32_t t = 0; t < 30000; t++) hits[plc_pick(&m, 0, 0, t)]++;
    for (int s = 0; s < m.n_slots; s++)
        if (m.slot_expert[s] == 0)
            CHECKF(fabs(hits[s] / 30000.0 - m.slot_share[s]) < 0.01, "slot %d: %d hits, share %.3f",
                   s, hits[s], (double)m.slot_share[s]);
    plc_map_free(&m);
}

static void test_refusals(void)
{
    static struct fixture f;
    make_fixture(&f, 64, 4);
    char err[MS_ERR_LEN];
    struct plc_map m;
    struct plc_stats only_load = {.flops = f.flops};
    struct plc_params pp = {.policy = PLC_POLICY_EPLB, .n_dev = 4, .redundant = 64 * 3 + 1};
    CHECK(plc_compute(&f.md, &pp, &only_load, &m, err, sizeof err) != 0 &&
          strstr(err, "--redundant-experts"));
    pp.redundant = 8;
    pp.slots_per_dev = 16;
    CHECK(plc_compute(&f.md, &pp, &only_load, &m, err, sizeof err) != 0 &&
          strstr(err, "--max-experts-per-device"));
    pp = (struct plc_params){.policy = PLC_POLICY_C2R, .n_dev = 4};
    CHECK(plc_compute(&f.md, &pp, &only_load, &m, err, sizeof err) != 0 &&
          strstr(err, "co-activation"));
    CHECK(plc_compute(&f.md, &pp, NULL, &m, err, sizeof err) != 0);
    struct plc_model flat = f.md;
    flat.n_group = 0;
    flat.expert_group = NULL;
    pp.policy = PLC_POLICY_MOHGE;
    CHECK(plc_compute(&flat, &pp, &only_load, &m, err, sizeof err) != 0 && strstr(err, "groups"));
    pp.policy = PLC_POLICY_EPLB;
    pp.redundant = -1;
    CHECK(plc_compute(&f.md, &pp, &only_load, &m, err, sizeof err) != 0);
    int owner[4] = {0, 1, 2, 3};
    CHECK(plc_map_from_owner(&m, 1, 4, 3, owner, err, sizeof err) != 0 && strstr(err, "device 3"));
    CHECK(plc_policy_parse("eplb", &pp.policy) == 0 && pp.policy == PLC_POLICY_EPLB);
    CHECK(plc_policy_parse("random", &pp.policy) != 0);
}

/* Writes synthetic routing to a trace and runs the simulator's experiment on it. */
static void test_sim_synthetic(void)
{
    char err[MS_ERR_LEN], path[] = "/tmp/moeserve_test_placement_XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) return;
    close(fd);
    struct rsynth_config c = {.n_layer = 4, .n_expert = 64, .top_k = 4, .d_model = 256,
                              .width = 512, .cluster = 8, .p_in = 0.8, .topic_skew = 1.0,
                              .expert_skew = 0.6, .seed = 11};
    struct rsynth *sy = NULL;
    struct rtrace_writer *w = NULL;
    if (rsynth_create(&c, &sy, err, sizeof err) != 0) return;
    struct rtrace_info in = {.n_layer = 4, .n_expert = 64, .top_k = 4, .d_model = 256,
                             .expert_width = rsynth_widths(sy)};
    static int32_t ids[4 * 256 * 4];
    int rc = rtrace_writer_open(path, &in, 0, 256, &w, err, sizeof err);
    CHECKF(rc == 0, "%s", err);
    for (int s = 0; rc == 0 && s < 128; s++) {
        rsynth_step(sy, 256, ids, NULL);
        struct rtrace_step st = {.step = (uint64_t)s, .n_tok = 256, .ids = ids};
        rc = rtrace_write_step(w, &st, err, sizeof err);
    }
    CHECK(rtrace_writer_close(w, err, sizeof err) == 0);
    rsynth_free(sy);

    int devs[] = {8};
    enum plc_policy pols[] = {PLC_POLICY_CONTIGUOUS, PLC_POLICY_EPLB, PLC_POLICY_C2R,
                              PLC_POLICY_MOHGE};
    struct psim_cell cells[4];
    struct psim_summary sum;
    struct psim_run_params p = {.trace = path, .tokens_per_dev = 256, .min_steps = 8,
                                .redundant = -1, .replicas_per_dev = 1, .seed = 1};
    rc = psim_run(&p, devs, 1, pols, 4, cells, &sum, err, sizeof err);
    CHECKF(rc == 0, "%s", err);
    if (rc == 0) {
        const struct psim_result *co = &cells[0].r, *ep = &cells[1].r, *c2 = &cells[2].r;
        CHECK(cells[0].ok && cells[1].ok && cells[2].ok);
        CHECK(!cells[3].ok && strstr(cells[3].why, "groups")); /* no groups in this model */
        CHECK(sum.fit_tokens == 64 * 256 && sum.eval_tokens == 64 * 256);
        CHECK(co->steps >= 8 && co->tokens >= 8 * 2048);
        /* eplb, one replica per device: balanced on held-out routing */
        CHECKF(ep->imbalance_window <= 1.05 && ep->imbalance <= 1.10,
               "eplb imbalance %.4f (steps %.4f)", ep->imbalance_window, ep->imbalance);
        CHECKF(co->imbalance > ep->imbalance + 0.1, "contiguous %.3f eplb %.3f", co->imbalance,
               ep->imbalance);
        /* c2r: >= 20% fewer tokens sent to other devices, imbalance <= 1.10 */
        CHECKF(c2->cross_sends <= 0.8 * co->cross_sends, "c2r %.4f contiguous %.4f",
               c2->cross_sends, co->cross_sends);
        CHECKF(c2->imbalance <= 1.10, "c2r imbalance %.4f", c2->imbalance);
        /* without deduplication every placement crosses at (N - 1) / N */
        CHECK(fabs(co->cross_rows - 7.0 / 8) < 0.01 && fabs(c2->cross_rows - 7.0 / 8) < 0.01);
        CHECK(ep->mem_max > co->mem_max); /* replicas cost memory */
    }
    unlink(path);
}

static void test_sim_bundled(const char *tests)
{
    char err[MS_ERR_LEN];
    int devs[] = {2, 4, 8, 64, 256};
    enum plc_policy pols[] = {PLC_POLICY_CONTIGUOUS, PLC_POLICY_MOHGE, PLC_POLICY_EPLB,
                              PLC_POLICY_C2R};
    struct psim_cell cells[5 * 4];
    struct psim_summary sum;
    struct psim_run_params p = {.trace = test_path(tests, "fixtures/routing/mohge_small_heldout.rtrace"),
                                .tokens_per_dev = 64, .min_steps = 4, .redundant = -1,
                                .replicas_per_dev = 1, .seed = 1};
    int rc = psim_run(&p, devs, 5, pols, 4, cells, &sum, err, sizeof err);
    CHECKF(rc == 0, "%s", err);
    if (rc) return;
    CHECK(sum.n_expert == 16 && sum.n_group == 4);
    for (int i = 0; i < 20; i++) CHECKF(cells[i].ok, "cell %d: %s", i, cells[i].why);
    /* mohge evens widths better than contiguous; eplb with replicas better still at 64 and
     * 256 devices, where 16 experts cannot cover the devices without them. */
    CHECK(cells[0 * 4 + 1].r.imbalance_window < cells[0 * 4 + 0].r.imbalance_window);
    CHECK(cells[3 * 4 + 2].r.imbalance < 0.5 * cells[3 * 4 + 0].r.imbalance);
    CHECK(cells[4 * 4 + 2].r.imbalance < 0.2 * cells[4 * 4 + 0].r.imbalance);

    /* A corrupt trace: refused with its offset. */
    char bad[] = "/tmp/moeserve_test_placement_bad_XXXXXX";
    int fd = mkstemp(bad);
    FILE *in = fopen(p.trace, "rb"), *out = fdopen(fd, "wb");
    int ch;
    long i = 0;
    while (in && out && (ch = fgetc(in)) != EOF) fputc(i++ == 3000 ? ch ^ 1 : ch, out);
    if (in) fclose(in);
    if (out) fclose(out);
    p.trace = bad;
    CHECK(psim_run(&p, devs, 5, pols, 4, cells, &sum, err, sizeof err) != 0 &&
          strstr(err, "offset"));
    unlink(bad);
}

int main(int argc, char **argv)
{
    test_eplb_nodes();
    const char *tests = argc > 1 ? argv[1] : "tests";
    test_valid_maps();
    test_eplb_balance();
    test_pick();
    test_refusals();
    test_sim_synthetic();
    test_sim_bundled(tests);
    return test_done("test_placement");
}

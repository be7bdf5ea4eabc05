/* Speculative decoding's small parts: --speculative-config parsing and checking, the n-gram
 * prompt-lookup proposer, and the adaptive draft length (per-sequence acceptance counts and a
 * fitted step-cost line). See spec.h for how they combine with the scheduler. */
#include "spec.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "common.h"

/* --- configuration ------------------------------------------------------------------------- */

const char *spec_method_name(enum spec_method m)
{
    switch (m) {
    case SPEC_NGRAM:
        return "ngram";
    case SPEC_DRAFT_MODEL:
        return "draft_model";
    case SPEC_MTP:
        return "mtp";
    default:
        return "off";
    }
}

/* An integer field in [lo, hi]: 0 absent, 1 set, -1 error (named). */
static int cfg_int(json_t *o, const char *key, int lo, int hi, int *out, char *err, size_t errlen)
{
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi)
        return ms_errf(err, errlen, "%s: must be an integer in %d..%d", key, lo, hi);
    *out = (int)json_integer_value(v);
    return 1;
}

int spec_config_parse(const char *json, struct spec_config *out, char *err, size_t errlen)
{
    memset(out, 0, sizeof *out);
    out->adaptive = true;
    json_error_t jerr;
    json_t *o = json_loads(json, JSON_REJECT_DUPLICATES, &jerr);
    if (!o) return ms_errf(err, errlen, "not JSON: %s (at character %d)", jerr.text, jerr.position);
    int rc = -1;
    if (!json_is_object(o)) {
        ms_errf(err, errlen,
                "must be a JSON object such as "
                "{\"method\": \"ngram\", \"num_speculative_tokens\": 4}");
        goto out;
    }
    static const char *const known[] = {
        "method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
        "model",  "quantization",           "adaptive"};
    const char *key;
    json_t *v;
    json_object_foreach(o, key, v)
    {
        bool ok = false;
        for (size_t i = 0; i < sizeof known / sizeof *known && !ok; i++)
            ok = strcmp(key, known[i]) == 0;
        if (!ok) {
            ms_errf(err, errlen,
                    "%s: unknown field (known: method, num_speculative_tokens, "
                    "prompt_lookup_min, prompt_lookup_max, model, quantization, "
                    "adaptive)",
                    key);
            goto out;
        }
    }
    json_t *jm = json_object_get(o, "method"), *jmodel = json_object_get(o, "model");
    if (jmodel && !json_is_null(jmodel)) {
        if (!json_is_string(jmodel) || json_string_length(jmodel) == 0 ||
            json_string_length(jmodel) >= sizeof out->model) {
            ms_errf(err, errlen, "model: must be a model folder (a non-empty string)");
            goto out;
        }
        snprintf(out->model, sizeof out->model, "%s", json_string_value(jmodel));
    }
    if (jm && !json_is_null(jm)) {
        if (!json_is_string(jm)) {
            ms_errf(err, errlen, "method: must be a string (ngram, draft_model or mtp)");
            goto out;
        }
        const char *m = json_string_value(jm);
        if (strcmp(m, "ngram") == 0) {
            out->method = SPEC_NGRAM;
        } else if (strcmp(m, "draft_model") == 0) {
            out->method = SPEC_DRAFT_MODEL;
        } else if (strcmp(m, "mtp") == 0 || strcmp(m, "deepseek_mtp") == 0 ||
                   strcmp(m, "qwen3_next_mtp") == 0 || strcmp(m, "glm4_moe_mtp") == 0 ||
                   strcmp(m, "mimo_mtp") == 0) {
            out->method = SPEC_MTP;
        } else {
            ms_errf(err, errlen,
                    "method: unknown speculative method '%s' (ngram, draft_model, "
                    "mtp)",
                    m);
            goto out;
        }
    } else if (out->model[0] &&
               (strcmp(out->model, "ngram") == 0 || strcmp(out->model, "[ngram]") == 0)) {
        out->method = SPEC_NGRAM; /* vLLM's older spelling */
        out->model[0] = '\0';
    } else if (out->model[0]) {
        out->method = SPEC_DRAFT_MODEL;
    } else {
        ms_errf(err, errlen,
                "method: missing (ngram, draft_model or mtp; or give a draft model "
                "folder as model)");
        goto out;
    }
    if (out->method == SPEC_DRAFT_MODEL && !out->model[0]) {
        ms_errf(err, errlen, "model: draft_model needs the draft model's folder");
        goto out;
    }
    if (out->method != SPEC_DRAFT_MODEL && out->model[0]) {
        ms_errf(err, errlen, "model: only the draft_model method takes a model (method is %s)",
                spec_method_name(out->method));
        goto out;
    }
    json_t *jk = json_object_get(o, "num_speculative_tokens");
    if (!jk || json_is_null(jk)) {
        ms_errf(err, errlen, "num_speculative_tokens: missing (1..%d)", SPEC_MAX_K);
        goto out;
    }
    if (cfg_int(o, "num_speculative_tokens", 1, SPEC_MAX_K, &out->k, err, errlen) < 0) goto out;
    int lmin = 0, lmax = 0;
    int has_min = cfg_int(o, "prompt_lookup_min", 1, 64, &lmin, err, errlen);
    if (has_min < 0) goto out;
    int has_max = cfg_int(o, "prompt_lookup_max", 1, 64, &lmax, err, errlen);
    if (has_max < 0) goto out;
    if ((has_min || has_max) && out->method != SPEC_NGRAM) {
        ms_errf(err, errlen, "%s: only the ngram method looks up n-grams (method is %s)",
                has_min ? "prompt_lookup_min" : "prompt_lookup_max", spec_method_name(out->method));
        goto out;
    }
    if (!has_min && !has_max) {
        lmin = 2;
        lmax = 5;
    } else if (!has_min) {
        lmin = lmax < 2 ? lmax : 2;
    } else if (!has_max) {
        lmax = lmin > 5 ? lmin : 5;
    }
    if (lmin > lmax) {
        ms_errf(err, errlen, "prompt_lookup_min: %d is more than prompt_lookup_max %d", lmin, lmax);
        goto out;
    }
    out->lookup_min = lmin;
    out->lookup_max = lmax;
    json_t *jq = json_object_get(o, "quantization");
    if (jq && !json_is_null(jq)) {
        const char *q = json_is_string(jq) ? json_string_value(jq) : "";
        if (strcmp(q, "none") != 0 && strcmp(q, "int8") != 0 && strcmp(q, "int4") != 0) {
            ms_errf(err, errlen,
                    "quantization: must be none, int8 or int4 (the draft model's, "
                    "made at load)");
            goto out;
        }
        if (out->method != SPEC_DRAFT_MODEL) {
            ms_errf(err, errlen, "quantization: only a draft model is loaded (method is %s)",
                    spec_method_name(out->method));
            goto out;
        }
        snprintf(out->quantization, sizeof out->quantization, "%s", q);
    }
    json_t *ja = json_object_get(o, "adaptive");
    if (ja && !json_is_null(ja)) {
        if (!json_is_boolean(ja)) {
            ms_errf(err, errlen, "adaptive: must be true or false");
            goto out;
        }
        out->adaptive = json_is_true(ja);
    }
    rc = 0;
out:
    json_decref(o);
    return rc;
}

/* --- n-gram prompt lookup ------------------------------------------------------------------ */

int spec_ngram_propose(const int32_t *tokens, int len, int min_n, int max_n, int k, int32_t *out)
{
    if (k <= 0 || min_n < 1) return 0;
    for (int n = max_n < len - 1 ? max_n : len - 1; n >= min_n; n--) {
        const int32_t *tail = tokens + len - n;
        /* the latest start i < len - n whose n tokens equal the tail: recent context predicts
         * best (a loop the model is in, the line being edited) */
        for (int i = len - n - 1; i >= 0; i--) {
            if (tokens[i] != tail[0] || memcmp(tokens + i, tail, sizeof(int32_t) * (size_t)n) != 0)
                continue;
            int avail = len - (i + n), m = k < avail ? k : avail;
            memcpy(out, tokens + i + n, sizeof(int32_t) * (size_t)m);
            return m;
        }
    }
    return 0;
}

/* --- adaptive k ---------------------------------------------------------------------------- */

/* Weight of past verifications against the new one: about the last 10 count. */
#define SPEC_ACC_DECAY 0.9f
/* Steps without drafting after which a sequence drafts one token to measure its rate again. */
#define SPEC_PROBE_STEPS 16

void spec_acc_init(struct spec_acc *a)
{
    a->acc = a->rej = 0.0f;
    a->idle = a->verified = 0;
}

void spec_acc_update(struct spec_acc *a, int drafted, int accepted)
{
    if (drafted <= 0) return;
    a->acc = a->acc * SPEC_ACC_DECAY + (float)accepted;
    a->rej = a->rej * SPEC_ACC_DECAY + (accepted < drafted ? 1.0f : 0.0f);
    a->verified++;
}

double spec_acc_rate(const struct spec_acc *a)
{
    return ((double)a->acc + 1.0) / ((double)a->acc + (double)a->rej + 2.0);
}

/* Weight of past steps in the cost fit: about the last 200 steps count. */
#define SPEC_COST_DECAY 0.995
/* Until the fit has seen steps of different sizes: t1 / t0. */
#define SPEC_COST_PRIOR 0.03125

void spec_cost_init(struct spec_cost *c)
{
    memset(c, 0, sizeof *c);
}

void spec_cost_observe(struct spec_cost *c, int tokens, double seconds)
{
    if (tokens <= 0 || !(seconds > 0) || !isfinite(seconds)) return;
    double x = (double)tokens;
    c->w = c->w * SPEC_COST_DECAY + 1.0;
    c->sx = c->sx * SPEC_COST_DECAY + x;
    c->sy = c->sy * SPEC_COST_DECAY + seconds;
    c->sxx = c->sxx * SPEC_COST_DECAY + x * x;
    c->sxy = c->sxy * SPEC_COST_DECAY + x * seconds;
}

void spec_cost_observe_draft(struct spec_cost *c, int tokens, double seconds)
{
    if (tokens <= 0 || !(seconds >= 0) || !isfinite(seconds)) return;
    c->dw = c->dw * SPEC_COST_DECAY + (double)tokens;
    c->ds = c->ds * SPEC_COST_DECAY + seconds;
}

void spec_cost_observe_feed(struct spec_cost *c, int n_seqs, double seconds)
{
    if (n_seqs <= 0 || !(seconds >= 0) || !isfinite(seconds)) return;
    c->fw = c->fw * SPEC_COST_DECAY + (double)n_seqs;
    c->fs = c->fs * SPEC_COST_DECAY + seconds;
}

/* The fitted line t0 + t1 T, in seconds, or (the prior) in units of t0; *unit: seconds per unit
 * (1 once fitted). */
static void cost_line(const struct spec_cost *c, double *t0, double *t1, double *unit)
{
    *t0 = 1.0, *t1 = SPEC_COST_PRIOR, *unit = 1.0;
    double my = c->w > 2.0 ? c->sy / c->w : 0.0;
    if (!(c->w > 2.0 && my > 0)) return;
    double mx = c->sx / c->w;
    double var = c->sxx / c->w - mx * mx, cov = c->sxy / c->w - mx * my;
    /* a spread of at least one token among the steps seen: the line is determined */
    if (var > 0.25) {
        *t1 = cov / var;
        if (*t1 < 0) *t1 = 0;
        *t0 = my - *t1 * mx;
        /* a fixed cost can not be negative; a fit that says so has too little data: keep a
         * tenth of the mean step as the fixed part */
        if (*t0 < 0.1 * my) *t0 = 0.1 * my;
    } else {
        *unit = my / (1.0 + SPEC_COST_PRIOR * mx); /* t0 in seconds under the prior */
    }
}

double spec_cost_threshold(const struct spec_cost *c, int n_seqs, int n_tokens)
{
    if (n_seqs < 1) n_seqs = 1;
    if (n_tokens < n_seqs) n_tokens = n_seqs;
    double t0, t1, unit;
    cost_line(c, &t0, &t1, &unit);
    /* proposing a draft (a draft model's steps), per drafted token, in the same units */
    double draft = c->dw > 0 && unit > 0 ? c->ds / c->dw / unit : 0.0;
    double th = (double)n_seqs * (t1 + draft) / (t0 + t1 * (double)n_tokens);
    return th < 0 ? 0 : th > 1 ? 1 : th;
}

/* Verifications a sequence has had before its feed is judged. */
#define SPEC_FEED_MIN_VERIFIED 8

bool spec_feed_pays(const struct spec_config *cfg, const struct spec_cost *c,
                    const struct spec_acc *a, int n_seqs, int n_tokens)
{
    if (!cfg->adaptive || a->verified < SPEC_FEED_MIN_VERIFIED || !(c->fw > 0)) return true;
    if (n_seqs < 1) n_seqs = 1;
    if (n_tokens < n_seqs) n_tokens = n_seqs;
    double t0, t1, unit;
    cost_line(c, &t0, &t1, &unit);
    if (!(unit > 0)) return true;
    double feed = c->fs / c->fw / unit * (double)n_seqs / (t0 + t1 * (double)n_tokens);
    double th = spec_cost_threshold(c, n_seqs, n_tokens), rate = spec_acc_rate(a);
    double p = 1.0, net = 0.0, best = 0.0;
    for (int k = 1; k <= cfg->k; k++) {
        p *= rate;
        net += p - th;
        if (net > best) best = net;
    }
    return best > feed;
}

int spec_choose_k(const struct spec_config *cfg, const struct spec_acc *a, double threshold)
{
    if (!cfg->adaptive) return cfg->k;
    double rate = spec_acc_rate(a), p = 1.0;
    int k = 0;
    while (k < cfg->k) {
        p *= rate;
        if (!(p > threshold)) break;
        k++;
    }
    if (k == 0 && a->idle >= SPEC_PROBE_STEPS) k = 1;
    return k;
}

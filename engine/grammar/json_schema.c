/* JSON Schema to EBNF (see json_schema.h). One rule per schema node, named rN, written after
 * its sub-rules; a $ref gets its rule name before its target is generated, so recursive
 * schemas become recursive rules. Objects with optional properties use one rule per
 * (property index, "a property came before") pair, which places the commas exactly. */
#include <jansson.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "grm_internal.h"
#include "json_schema.h"

#define MAX_DEPTH 64
#define MAX_REFS 256
#define MAX_COUNT 1000 /* minItems, maxItems, minLength, maxLength */

struct js {
    struct grm_txt out;
    const char *pfx; /* rule-name prefix (several schemas in one grammar) */
    json_t *root;
    int n_rules;
    const char *ref_names[MAX_REFS];
    int ref_rule[MAX_REFS];
    int n_refs;
    char *err;
    size_t errlen;
    char *kw;
    size_t kwlen;
    bool failed;
};

static int fail(struct js *j, const char *keyword, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int fail(struct js *j, const char *keyword, const char *fmt, ...)
{
    if (j->failed) return -1;
    j->failed = true;
    va_list ap;
    va_start(ap, fmt);
    if (j->err && j->errlen) vsnprintf(j->err, j->errlen, fmt, ap);
    va_end(ap);
    if (keyword && j->kw && j->kwlen) snprintf(j->kw, j->kwlen, "%s", keyword);
    return -1;
}

static const char *const BASE =
    "ws ::= [ \\t\\n]{0,20}\n"
    "json_value ::= json_object | json_array | json_string | json_number | \"true\" | \"false\" | \"null\"\n"
    "json_object ::= \"{\" ws ( json_member ( \",\" ws json_member )* )? \"}\"\n"
    "json_member ::= json_string ws \":\" ws json_value ws\n"
    "json_array ::= \"[\" ws ( json_value ws ( \",\" ws json_value ws )* )? \"]\"\n"
    "json_string ::= \"\\\"\" json_char* \"\\\"\"\n"
    "json_char ::= [^\"\\\\\\x00-\\x1F] | \"\\\\\" ( [\"\\\\/bfnrt] | \"u\" [0-9a-fA-F]{4} )\n"
    "json_int ::= \"-\"? ( \"0\" | [1-9] [0-9]{0,15} )\n"
    "json_number ::= json_int ( \".\" [0-9]{1,16} )? ( [eE] [-+]? [0-9]{1,3} )?\n"
    "json_date ::= [1-9] [0-9]{3} \"-\" ( \"0\" [1-9] | \"1\" [0-2] ) \"-\" ( \"0\" [1-9] | \"1\" [0-9] | \"2\" [0-8] )\n"
    "json_time ::= ( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] \":\" [0-5] [0-9] ( \".\" [0-9]{1,6} )? "
    "( \"Z\" | [+-] ( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] )\n"
    "json_hex ::= [0-9a-f]\n"
    "json_uuid ::= json_hex{8} \"-\" json_hex{4} \"-\" json_hex{4} \"-\" json_hex{4} \"-\" json_hex{12}\n";

static bool is_annotation(const char *k)
{
    static const char *const a[] = {"title", "description", "default", "examples", "$schema",
                                    "$id", "$comment", "deprecated", "readOnly", "writeOnly",
                                    "strict", "$defs", "definitions"};
    for (size_t i = 0; i < sizeof a / sizeof *a; i++)
        if (strcmp(k, a[i]) == 0) return true;
    return false;
}

static bool is_known(const char *k)
{
    static const char *const a[] = {"type", "enum", "const", "properties", "required",
                                    "additionalProperties", "items", "minItems", "maxItems",
                                    "anyOf", "allOf", "$ref", "format", "minLength",
                                    "maxLength", "pattern", "nullable", "uniqueItems"};
    for (size_t i = 0; i < sizeof a / sizeof *a; i++)
        if (strcmp(k, a[i]) == 0) return true;
    return false;
}

static int gen(struct js *j, json_t *s, int depth);

static int new_rule(struct js *j)
{
    return j->n_rules++;
}

/* Writes "rN ::= body\n". */
static void emit(struct js *j, int rule, const struct grm_txt *body)
{
    grm_txt_putf(&j->out, "%sr%d ::= ", j->pfx, rule);
    grm_txt_put(&j->out, body->p ? body->p : "\"\"", body->p ? body->len : 2);
    grm_txt_put(&j->out, "\n", 1);
}

static int count_kw(struct js *j, json_t *s, const char *k, long dflt, long *out)
{
    json_t *v = json_object_get(s, k);
    *out = dflt;
    if (!v) return 0;
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > MAX_COUNT)
        return fail(j, k, "JSON Schema: '%s' must be an integer in [0, %d]", k, MAX_COUNT);
    *out = (long)json_integer_value(v);
    return 0;
}

/* "x{lo,hi}" with hi < 0 unbounded. */
static void put_repeat(struct grm_txt *b, const char *x, long lo, long hi)
{
    if (lo == 0 && hi < 0) grm_txt_putf(b, "%s*", x);
    else if (hi < 0) grm_txt_putf(b, "%s{%ld,}", x, lo);
    else grm_txt_putf(b, "%s{%ld,%ld}", x, lo, hi);
}

static int gen_string(struct js *j, json_t *s, struct grm_txt *b)
{
    json_t *fmt = json_object_get(s, "format");
    json_t *pat = json_object_get(s, "pattern");
    long lo, hi;
    if (count_kw(j, s, "minLength", 0, &lo) < 0 || count_kw(j, s, "maxLength", -1, &hi) < 0)
        return -1;
    if (hi >= 0 && hi < lo) return fail(j, "maxLength", "JSON Schema: maxLength < minLength");
    if (fmt) {
        const char *f = json_string_value(fmt);
        const char *rule = !f ? NULL : strcmp(f, "date") == 0 ? "json_date"
                                   : strcmp(f, "time") == 0   ? "json_time"
                                   : strcmp(f, "uuid") == 0   ? "json_uuid"
                                   : strcmp(f, "date-time") == 0 ? "json_date \"T\" json_time"
                                                                 : NULL;
        if (!rule)
            return fail(j, "format", "JSON Schema: format '%s' is not supported (date, time, "
                                     "date-time, uuid are)", f ? f : "?");
        if (pat || json_object_get(s, "minLength") || json_object_get(s, "maxLength"))
            return fail(j, pat ? "pattern" : "minLength",
                        "JSON Schema: a string with a format takes no pattern or length bounds");
        grm_txt_putf(b, "\"\\\"\" %s \"\\\"\"", rule);
        return 0;
    }
    if (pat) {
        const char *re = json_string_value(pat);
        size_t n = re ? strlen(re) : 0;
        if (!re || n < 2 || re[0] != '^' || re[n - 1] != '$')
            return fail(j, "pattern", "JSON Schema: a pattern must be anchored (^...$)");
        if (json_object_get(s, "minLength") || json_object_get(s, "maxLength"))
            return fail(j, "minLength", "JSON Schema: a pattern takes no length bounds here");
        /* The pattern constrains the decoded string; the grammar writes it encoded. Refuse
         * what could produce a quote, a backslash or a control character. */
        for (size_t i = 0; i < n; i++) {
            if (re[i] == '\\' && i + 1 < n) {
                char e = re[i + 1];
                if (e == '\\' || e == '"' || e == 'D' || e == 'W' || e == 'S' || e == 'n' ||
                    e == 't' || e == 'r' || e == 's' || e == 'x' || e == 'u')
                    return fail(j, "pattern",
                                "JSON Schema: this pattern could need JSON escapes (\\%c); not "
                                "supported",
                                e);
                i++;
                continue;
            }
            if (re[i] == '.' || re[i] == '"' || (re[i] == '[' && i + 1 < n && re[i + 1] == '^') ||
                (unsigned char)re[i] < 0x20)
                return fail(j, "pattern",
                            "JSON Schema: patterns with '.', negated classes or quotes are not "
                            "supported");
        }
        char *ebnf = NULL;
        char err[256];
        if (grm_regex_to_ebnf(re, &ebnf, err, sizeof err) < 0)
            return fail(j, "pattern", "JSON Schema: pattern: %s", err);
        grm_txt_puts(b, "\"\\\"\" (");
        grm_txt_put(b, ebnf, strlen(ebnf));
        grm_txt_puts(b, " ) \"\\\"\"");
        free(ebnf);
        return 0;
    }
    grm_txt_puts(b, "\"\\\"\" ");
    put_repeat(b, "json_char", lo, hi);
    grm_txt_puts(b, " \"\\\"\"");
    return 0;
}

static int gen_array(struct js *j, json_t *s, int depth, struct grm_txt *b)
{
    json_t *items = json_object_get(s, "items");
    json_t *uniq = json_object_get(s, "uniqueItems");
    if (uniq && !json_is_false(uniq))
        return fail(j, "uniqueItems", "JSON Schema: uniqueItems is not supported");
    long lo, hi;
    if (count_kw(j, s, "minItems", 0, &lo) < 0 || count_kw(j, s, "maxItems", -1, &hi) < 0)
        return -1;
    if (hi >= 0 && hi < lo) return fail(j, "maxItems", "JSON Schema: maxItems < minItems");
    if (items && json_is_false(items)) hi = 0;
    if (hi == 0) {
        if (lo > 0) return fail(j, "minItems", "JSON Schema: items false with minItems > 0");
        grm_txt_puts(b, "\"[\" ws \"]\"");
        return 0;
    }
    char item[32];
    if (!items || json_is_true(items)) {
        snprintf(item, sizeof item, "json_value");
    } else {
        int r = gen(j, items, depth + 1);
        if (r < 0) return -1;
        snprintf(item, sizeof item, "%sr%d", j->pfx, r);
    }
    char more[80];
    snprintf(more, sizeof more, "( \",\" ws %s ws )", item);
    if (lo == 0) {
        grm_txt_putf(b, "\"[\" ws ( %s ws ", item);
        put_repeat(b, more, 0, hi < 0 ? -1 : hi - 1);
        grm_txt_puts(b, " )? \"]\"");
    } else {
        grm_txt_putf(b, "\"[\" ws %s ws ", item);
        put_repeat(b, more, lo - 1, hi < 0 ? -1 : hi - 1);
        grm_txt_puts(b, " \"]\"");
    }
    return 0;
}

static int gen_object(struct js *j, json_t *s, int depth, struct grm_txt *b)
{
    json_t *props = json_object_get(s, "properties");
    json_t *req = json_object_get(s, "required");
    json_t *addl = json_object_get(s, "additionalProperties");
    if (props && !json_is_object(props))
        return fail(j, "properties", "JSON Schema: 'properties' must be an object");
    if (req && !json_is_array(req))
        return fail(j, "required", "JSON Schema: 'required' must be an array");
    size_t n_req = json_array_size(req), i;
    json_t *v;
    json_array_foreach(req, i, v) if (!json_is_string(v))
        return fail(j, "required", "JSON Schema: 'required' must hold property names");
    /* the properties in order, then required names with no schema */
    size_t np = json_object_size(props) + n_req;
    const char **names = calloc(np ? np : 1, sizeof *names);
    json_t **schemas = calloc(np ? np : 1, sizeof *schemas);
    bool *required = calloc(np ? np : 1, sizeof *required);
    int *kv = calloc(np ? np : 1, sizeof *kv);
    int rc = -1;
    if (!names || !schemas || !required || !kv) {
        fail(j, NULL, "out of memory");
        goto out;
    }
    size_t n = 0;
    const char *key;
    /* name -> index, so that 'required' is matched in linear time (10^4 properties) */
    json_t *index = json_object();
    if (!index) {
        fail(j, NULL, "out of memory");
        goto out;
    }
    json_object_foreach(props, key, v)
    {
        names[n] = key;
        schemas[n] = v;
        if (json_object_set_new(index, key, json_integer((json_int_t)n)) < 0) {
            json_decref(index);
            fail(j, NULL, "out of memory");
            goto out;
        }
        n++;
    }
    json_array_foreach(req, i, v)
    {
        json_t *at = json_object_get(index, json_string_value(v));
        size_t k = at ? (size_t)json_integer_value(at) : n;
        if (k == n) {
            names[n] = json_string_value(v);
            schemas[n++] = NULL;
            if (json_object_set_new(index, names[k], json_integer((json_int_t)k)) < 0) {
                json_decref(index);
                fail(j, NULL, "out of memory");
                goto out;
            }
        }
        required[k] = true;
    }
    json_decref(index);
    if (n == 0) {
        /* no named properties: any members, their values as additionalProperties says */
        if (addl && json_is_false(addl)) {
            grm_txt_puts(b, "\"{\" ws \"}\"");
        } else if (!addl || json_is_true(addl)) {
            grm_txt_puts(b, "json_object");
        } else {
            int r = gen(j, addl, depth + 1);
            if (r < 0) goto out;
            grm_txt_putf(b, "\"{\" ws ( json_string ws \":\" ws %sr%d ws ( \",\" ws json_string ws \":\" ws "
                    "%sr%d ws )* )? \"}\"",
                 j->pfx, r, j->pfx, r);
        }
        rc = 0;
        goto out;
    }
    /* one rule per member: "name" ws ":" ws value ws */
    for (size_t k = 0; k < n; k++) {
        int vr = schemas[k] ? gen(j, schemas[k], depth + 1) : -1;
        if (schemas[k] && vr < 0) goto out;
        struct grm_txt m = {0};
        json_t *tmp = json_string(names[k]);
        char *q = tmp ? json_dumps(tmp, JSON_ENCODE_ANY | JSON_COMPACT) : NULL;
        json_decref(tmp);
        if (!q) {
            fail(j, NULL, "out of memory");
            goto out;
        }
        grm_txt_literal(&m, q, strlen(q));
        free(q);
        if (vr >= 0) grm_txt_putf(&m, " ws \":\" ws %sr%d ws", j->pfx, vr);
        else grm_txt_puts(&m, " ws \":\" ws json_value ws");
        kv[k] = new_rule(j);
        emit(j, kv[k], &m);
        free(m.p);
    }
    /* S(k, c): members k.. after c (0: none yet, 1: some) members; written back to front */
    int next[2] = {-1, -1};
    for (size_t kk = n; kk-- > 0;) {
        int cur[2];
        for (int c = 0; c < 2; c++) {
            struct grm_txt body = {0};
            if (c) grm_txt_puts(&body, "\",\" ws ");
            grm_txt_putf(&body, "%sr%d", j->pfx, kv[kk]);
            if (next[1] >= 0) grm_txt_putf(&body, " %sr%d", j->pfx, next[1]);
            if (!required[kk]) {
                if (next[c] >= 0) grm_txt_putf(&body, " | %sr%d", j->pfx, next[c]);
                else grm_txt_puts(&body, " | \"\"");
            }
            cur[c] = new_rule(j);
            emit(j, cur[c], &body);
            free(body.p);
        }
        next[0] = cur[0];
        next[1] = cur[1];
    }
    grm_txt_putf(b, "\"{\" ws %sr%d \"}\"", j->pfx, next[0]);
    rc = 0;
out:
    free(names);
    free(schemas);
    free(required);
    free(kv);
    return rc;
}

static int gen_type(struct js *j, json_t *s, const char *t, int depth, struct grm_txt *b)
{
    if (strcmp(t, "string") == 0) return gen_string(j, s, b);
    if (strcmp(t, "integer") == 0) {
        grm_txt_puts(b, "json_int");
        return 0;
    }
    if (strcmp(t, "number") == 0) {
        grm_txt_puts(b, "json_number");
        return 0;
    }
    if (strcmp(t, "boolean") == 0) {
        grm_txt_puts(b, "\"true\" | \"false\"");
        return 0;
    }
    if (strcmp(t, "null") == 0) {
        grm_txt_puts(b, "\"null\"");
        return 0;
    }
    if (strcmp(t, "object") == 0) return gen_object(j, s, depth, b);
    if (strcmp(t, "array") == 0) return gen_array(j, s, depth, b);
    return fail(j, "type", "JSON Schema: unknown type '%s'", t);
}

/* Resolves a local reference ("#", "#/$defs/x", any JSON pointer into the root). */
static json_t *resolve(struct js *j, const char *ref)
{
    if (ref[0] != '#') return NULL;
    json_t *at = j->root;
    const char *p = ref + 1;
    while (*p == '/' && at) {
        p++;
        char seg[256];
        size_t n = 0;
        while (*p && *p != '/' && n + 1 < sizeof seg) {
            if (p[0] == '~' && p[1] == '1') {
                seg[n++] = '/';
                p += 2;
            } else if (p[0] == '~' && p[1] == '0') {
                seg[n++] = '~';
                p += 2;
            } else {
                seg[n++] = *p++;
            }
        }
        seg[n] = '\0';
        at = json_object_get(at, seg);
    }
    return *p ? NULL : at;
}

/* gen with the rule body written to *bp, which the caller frees (also on failure: the
 * early returns below may leave text there). */
static int gen_into(struct js *j, json_t *s, int depth, struct grm_txt *bp)
{
    if (j->failed) return -1;
    /* gen recurses once per level (and per $ref followed): bounded */
    if (depth > MAX_DEPTH)
        return fail(j, NULL, "JSON Schema: schemas nested deeper than %d levels", MAX_DEPTH);
    int rule = -1;
    if (json_is_true(s)) {
        grm_txt_puts(bp, "json_value");
        goto done;
    }
    if (json_is_false(s)) return fail(j, NULL, "JSON Schema: the schema false matches nothing");
    if (!json_is_object(s)) return fail(j, NULL, "JSON Schema: a schema must be an object");
    const char *key;
    json_t *v;
    json_object_foreach(s, key, v)
    {
        if (!is_known(key) && !is_annotation(key))
            return fail(j, key, "JSON Schema keyword '%s' is not supported", key);
    }
    json_t *ref = json_object_get(s, "$ref");
    if (ref) {
        const char *r = json_string_value(ref);
        if (!r) return fail(j, "$ref", "JSON Schema: '$ref' must be a string");
        json_object_foreach(s, key, v) if (strcmp(key, "$ref") != 0 && !is_annotation(key))
            return fail(j, key, "JSON Schema: '%s' beside '$ref' is not supported", key);
        for (int i = 0; i < j->n_refs; i++)
            if (strcmp(j->ref_names[i], r) == 0) return j->ref_rule[i];
        json_t *target = resolve(j, r);
        if (!target) return fail(j, "$ref", "JSON Schema: cannot resolve '$ref' %s", r);
        if (j->n_refs == MAX_REFS) return fail(j, "$ref", "JSON Schema: too many $refs");
        rule = new_rule(j);
        j->ref_names[j->n_refs] = r;
        j->ref_rule[j->n_refs++] = rule;
        int tr = gen(j, target, depth + 1);
        if (tr < 0) return -1;
        grm_txt_putf(bp, "%sr%d", j->pfx, tr);
        emit(j, rule, bp);
        return rule;
    }
    json_t *cst = json_object_get(s, "const"), *en = json_object_get(s, "enum");
    json_t *any = json_object_get(s, "anyOf"), *all = json_object_get(s, "allOf");
    if (cst || en) {
        json_t *list = cst ? NULL : en;
        if (en && (!json_is_array(en) || json_array_size(en) == 0))
            return fail(j, "enum", "JSON Schema: 'enum' must be a non-empty array");
        size_t n = cst ? 1 : json_array_size(list), i;
        for (i = 0; i < n; i++) {
            json_t *val = cst ? cst : json_array_get(list, i);
            char *lit = json_dumps(val, JSON_ENCODE_ANY | JSON_COMPACT);
            if (!lit) return fail(j, NULL, "out of memory");
            if (i) grm_txt_puts(bp, " | ");
            grm_txt_literal(bp, lit, strlen(lit));
            free(lit);
        }
        goto done;
    }
    if (all) {
        if (!json_is_array(all) || json_array_size(all) != 1)
            return fail(j, "allOf", "JSON Schema: 'allOf' is supported with one schema only");
        int r = gen(j, json_array_get(all, 0), depth + 1);
        if (r < 0) return -1;
        grm_txt_putf(bp, "%sr%d", j->pfx, r);
        goto done;
    }
    if (any) {
        if (!json_is_array(any) || json_array_size(any) == 0)
            return fail(j, "anyOf", "JSON Schema: 'anyOf' must be a non-empty array");
        size_t i;
        json_array_foreach(any, i, v)
        {
            int r = gen(j, v, depth + 1);
            if (r < 0) return -1;
            grm_txt_putf(bp, i ? " | %sr%d" : "%sr%d", j->pfx, r);
        }
        goto done;
    }
    json_t *type = json_object_get(s, "type");
    bool nullable = json_is_true(json_object_get(s, "nullable"));
    if (!type) {
        if (json_object_get(s, "properties") || json_object_get(s, "required") ||
            json_object_get(s, "additionalProperties")) {
            if (gen_type(j, s, "object", depth, bp) < 0) return -1;
        } else if (json_object_get(s, "items") || json_object_get(s, "minItems") ||
                   json_object_get(s, "maxItems")) {
            if (gen_type(j, s, "array", depth, bp) < 0) return -1;
        } else if (json_object_get(s, "pattern") || json_object_get(s, "format") ||
                   json_object_get(s, "minLength") || json_object_get(s, "maxLength")) {
            if (gen_type(j, s, "string", depth, bp) < 0) return -1;
        } else {
            grm_txt_puts(bp, "json_value");
        }
    } else if (json_is_string(type)) {
        if (gen_type(j, s, json_string_value(type), depth, bp) < 0) return -1;
    } else if (json_is_array(type) && json_array_size(type) > 0) {
        size_t i;
        json_array_foreach(type, i, v)
        {
            if (!json_is_string(v)) return fail(j, "type", "JSON Schema: bad 'type'");
            struct grm_txt alt = {0};
            if (gen_type(j, s, json_string_value(v), depth, &alt) < 0) {
                free(alt.p);
                return -1;
            }
            int r = new_rule(j);
            emit(j, r, &alt);
            free(alt.p);
            grm_txt_putf(bp, i ? " | %sr%d" : "%sr%d", j->pfx, r);
        }
    } else {
        return fail(j, "type", "JSON Schema: 'type' must be a string or an array of strings");
    }
    if (nullable) grm_txt_puts(bp, " | \"null\"");
done:
    if (bp->failed) return fail(j, NULL, "out of memory");
    rule = new_rule(j);
    emit(j, rule, bp);
    return rule;
}

/* Generates the rule for schema s; returns its number. */
static int gen(struct js *j, json_t *s, int depth)
{
    struct grm_txt b = {0};
    int r = gen_into(j, s, depth, &b);
    free(b.p);
    return r;
}

/* The rules of one schema, named with prefix, its start rule "<prefix>root". */
static int schema_rules(const char *schema_json, const char *prefix, struct grm_txt *out, char *err,
                        size_t errlen, char *bad_keyword, size_t kwlen)
{
    json_error_t je;
    json_t *root = json_loads(schema_json, JSON_DECODE_ANY, &je);
    if (!root) return ms_errf(err, errlen, "JSON Schema: invalid JSON: %s", je.text);
    struct js j = {.root = root, .pfx = prefix, .err = err, .errlen = errlen,
                   .kw = bad_keyword, .kwlen = kwlen};
    j.out = *out;
    int r = gen(&j, root, 0);
    json_decref(root);
    if (r >= 0) grm_txt_putf(&j.out, "%sroot ::= %sr%d\n", prefix, prefix, r);
    *out = j.out;
    if (r < 0 || out->failed) {
        if (!j.failed) ms_errf(err, errlen, "out of memory");
        return -1;
    }
    return 0;
}

int jschema_to_ebnf(const char *schema_json, char **out, char *err, size_t errlen,
                    char *bad_keyword, size_t kwlen)
{
    *out = NULL;
    struct grm_txt t = {0};
    grm_txt_puts(&t, BASE);
    if (schema_rules(schema_json, "", &t, err, errlen, bad_keyword, kwlen) < 0) {
        free(t.p);
        return -1;
    }
    *out = t.p;
    return 0;
}

int jschema_rules(const char *schema_json, const char *prefix, char **text, char *err,
                  size_t errlen, char *bad_keyword, size_t kwlen)
{
    struct grm_txt t = {0};
    grm_txt_puts(&t, *text ? *text : "");
    free(*text);
    *text = NULL;
    int rc = schema_rules(schema_json, prefix, &t, err, errlen, bad_keyword, kwlen);
    if (rc < 0 || t.failed) {
        free(t.p);
        return rc < 0 ? -1 : ms_errf(err, errlen, "out of memory");
    }
    *text = t.p;
    return 0;
}

const char *jschema_base_rules(void)
{
    return BASE;
}

/* JSON Schema to grammar: writes the EBNF (grammar.h's dialect) of the JSON texts a schema
 * accepts, for structured output. The subset covers what OpenAI's strict mode allows and the
 * usual Pydantic output: type (one or a list), object (properties in their order, required,
 * additionalProperties), array (items, minItems, maxItems), string (minLength, maxLength,
 * pattern anchored ^...$ without negated classes or '.', format date / time / date-time /
 * uuid), number, integer, boolean, null, enum, const, anyOf, allOf of one schema, $ref to
 * "#", "#/$defs/..." or "#/definitions/..." (recursion included), nullable. Annotations
 * (title, description, default, examples, $schema, $id, $comment, deprecated, readOnly,
 * writeOnly, strict) are skipped. Any other keyword (minimum, oneOf, not, patternProperties,
 * ...) is refused and named, never ignored.
 *
 * The grammar emits compact JSON with optional whitespace (up to 20 characters) after '{',
 * '[', ',', ':' and values, properties in schema order (optional ones may be left out),
 * numbers of at most 16 digits before and after the point, and dates whose day is at most 28
 * (so every one is a real date), so every output that completes parses and validates. */
#ifndef MOESERVE_JSON_SCHEMA_H
#define MOESERVE_JSON_SCHEMA_H

#include <stddef.h>

/* Returns 0 and a malloc'd EBNF text in *out (the caller frees it), or -1 with a reason in err;
 * when the reason is a keyword the subset lacks, that keyword is in bad_keyword. */
int jschema_to_ebnf(const char *schema_json, char **out, char *err, size_t errlen,
                    char *bad_keyword, size_t kwlen);

/* Appends to *text (malloc'd or NULL; replaced by a new buffer) the rules of one schema, all
 * named with `prefix` and starting at "<prefix>root", without the shared json_* and ws rules
 * (jschema_base_rules, to be added once): several schemas in one grammar. Same errors. */
int jschema_rules(const char *schema_json, const char *prefix, char **text, char *err,
                  size_t errlen, char *bad_keyword, size_t kwlen);
const char *jschema_base_rules(void);

/* The regular-expression translator of grm_compile.c (used for "pattern"). */
int grm_regex_to_ebnf(const char *re, char **out, char *err, size_t errlen);

#endif

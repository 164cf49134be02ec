// The Unicode classes of GPT-2's pre-tokenisation pattern: letters (\p{L}), numbers (\p{N})
// and white space (\s, as JavaScript's regular expressions define it). The tables are generated
// by tools/generate_unicode_classes.js.
#pragma once

namespace weave::graphs::data {

bool is_letter(char32_t c);
bool is_number(char32_t c);
bool is_space(char32_t c);

}  // namespace weave::graphs::data

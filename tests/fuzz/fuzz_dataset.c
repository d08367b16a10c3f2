/* fuzz_dataset.c — libFuzzer target for the dataset reader, ds4.data.parse_jsonl (lua/ds4/data.lua): JSONL text
 * -> prompts / answers / conversations, through ds4.chat.json's decoder and, for conversations, the chat templates.
 *
 * Input: byte 0 picks the options (prompt/answer without and with a tokenizer; messages without a template, with
 * deepseek_v4 and with chatml, through the built-in byte-level tokenizer; the format detected from the first row;
 * prompt/completion rows; verl's layout and a custom column mapping), the rest is the file's text.
 * Properties: the reader returns rows or raises an error that names the file and line ("f.jsonl:N: ...", or
 * "f.jsonl: no rows"); never a Lua runtime error (a message with a "file.lua:N:" position); every returned row
 * holds what its format promises: a prompt with a non-space character, a non-empty string answer, at least one
 * prompt id (with a tokenizer), each below the vocabulary size; a non-empty array of messages with non-empty
 * string roles; SFT rows whose labels are -100 or their token, with at least one trained token. */
#include "lua_fuzz.h"

static const char CHUNK[] =
    "local ds4 = require('ds4')\n"
    "local data = require('ds4.data')\n"
    "local tok = ds4.tokenizer()\n"
    "local V = tok:vocab_size()\n"
    "local OPTS = {\n"
    "  {}, {tokenizer = tok}, {format = 'messages'},\n"
    "  {format = 'messages', tokenizer = tok, template = 'deepseek_v4', render_opts = {thinking = false}},\n"
    "  {format = 'messages', tokenizer = tok, template = 'chatml'},\n"
    "  {format = 'auto', tokenizer = tok, template = 'deepseek_v4'},\n"
    "  {format = 'prompt_completion', tokenizer = tok, template = 'chatml'},\n"
    "  {tokenizer = tok, template = 'deepseek_v4', columns = 'verl', thinking = true},\n"
    "  {format = 'auto', columns = {prompt = 'q', answer = 'a.b', completion = 'c', messages = 'm.x'}},\n"
    "}\n"
    "local function check_ids(r)\n"
    "  assert(#r.ids >= 1, 'no ids')\n"
    "  for _, id in ipairs(r.ids) do assert(id >= 0 and id < V, 'an id outside the vocabulary') end\n"
    "  if r.labels then\n"
    "    assert(#r.labels == #r.ids, 'labels and ids differ in length')\n"
    "    local trained = 0\n"
    "    for i, l in ipairs(r.labels) do\n"
    "      assert(l == -100 or l == r.ids[i], 'a label that is neither -100 nor its token')\n"
    "      if l ~= -100 then trained = trained + 1 end\n"
    "    end\n"
    "    assert(trained >= 1, 'a row that trains nothing')\n"
    "  end\n"
    "end\n"
    "function fuzz_one(s)\n"
    "  local o = OPTS[(s:byte(1) or 0) % #OPTS + 1]\n"
    "  local ok, rows = pcall(data.parse_jsonl, s:sub(2), 'f.jsonl', o)\n"
    "  if not ok then\n"
    "    local msg = tostring(rows)\n"
    "    if type(rows) ~= 'string' or msg:find('%.lua:%d+:') then error('runtime error: ' .. msg, 0) end\n"
    "    if not (msg:find('^f%.jsonl:%d+: ') or msg == 'f.jsonl: no rows (an empty file, or only blank lines)') then\n"
    "      error('an error that names no line: ' .. msg, 0)\n"
    "    end\n"
    "    return\n"
    "  end\n"
    "  assert(#rows >= 1, 'no rows and no error')\n"
    "  local fmt = rows.format\n"
    "  assert(fmt == 'messages' or fmt == 'prompt_answer' or fmt == 'prompt_completion', 'no format')\n"
    "  for i, r in ipairs(rows) do\n"
    "    assert(type(r.line) == 'number' and r.line >= 1, 'row without a line')\n"
    "    if fmt == 'messages' then\n"
    "      assert(type(r.messages) == 'table' and #r.messages >= 1, 'empty conversation')\n"
    "      for _, m in ipairs(r.messages) do\n"
    "        assert(type(m.role) == 'string' and #m.role > 0, 'bad role')\n"
    "        assert(m.content == nil or type(m.content) == 'string' or type(m.content) == 'table', 'bad content')\n"
    "      end\n"
    "      if o.template then check_ids(r) end\n"
    "    elseif fmt == 'prompt_completion' then\n"
    "      assert(type(r.prompt) == type(r.completion), 'prompt and completion of different kinds')\n"
    "      if r.ids then check_ids(r) end\n"
    "    else\n"
    "      assert(type(r.prompt) == 'string' and r.prompt:find('%S'), 'blank prompt accepted')\n"
    "      assert(type(r.answer) == 'string' and #r.answer > 0, 'answer not a non-empty string')\n"
    "      if o.tokenizer then check_ids(r) end\n"
    "    end\n"
    "  end\n"
    "end\n"
    "return tok\n";

DS4F_LUA_TARGET(CHUNK)

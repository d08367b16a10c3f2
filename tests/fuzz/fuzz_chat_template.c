/* fuzz_chat_template.c — libFuzzer target for the chat-template renderers (lua/ds4/chat/: deepseek_v4, chatml)
 * with the built-in byte-level tokenizer.
 *
 * Input: byte 0 picks the template, the rest is JSON: an array of messages, or {"messages": [...], "opts": {...}}
 * (a value that is not JSON is skipped: the decoder is fuzzed through fuzz_dataset). Messages come as the JSON
 * says — strings, numbers, nulls (json.null), nested objects, tool calls — as a user's dataset would give them.
 * Properties: render returns or raises an error that starts with the template's name (or "ds4.chat"), never a Lua
 * runtime error (a message with a "file.lua:N:" position); a returned render has one 0/1 mask value per id, every
 * id in the vocabulary, segments that tile the ids in order, and ids that decode to exactly its text. */
#include "lua_fuzz.h"

static const char CHUNK[] =
    "local ds4 = require('ds4')\n"
    "local chat = require('ds4.chat')\n"
    "local json = require('ds4.chat.json')\n"
    "local tok = ds4.tokenizer()\n"
    "local V = tok:vocab_size()\n"
    "local NAMES = {'deepseek_v4', 'chatml'}\n"
    "function fuzz_one(s)\n"
    "  local name = NAMES[(s:byte(1) or 0) % #NAMES + 1]\n"
    "  local v = json.decode(s:sub(2))\n"
    "  if v == nil then return end\n"
    "  local messages, opts = v, nil\n"
    "  if type(v) == 'table' and json.keys(v) ~= nil and v.messages ~= nil then messages, opts = v.messages, v.opts end\n"
    "  local t = chat.get(name)\n"
    "  local ok, r = pcall(t.render, t, tok, messages, opts)\n"
    "  if not ok then\n"
    "    local msg = tostring(r)\n"
    "    if type(r) ~= 'string' or msg:find('%.lua:%d+:') then error(name .. ': runtime error: ' .. msg, 0) end\n"
    "    if not (msg:find('^' .. name .. '[:. ]') or msg:find('^ds4%.chat')) then\n"
    "      error('an error that does not name the template: ' .. msg, 0)\n"
    "    end\n"
    "    return\n"
    "  end\n"
    "  assert(#r.ids == #r.mask, 'ids and mask differ in length')\n"
    "  for i, id in ipairs(r.ids) do\n"
    "    assert(id >= 0 and id < V, 'id outside the vocabulary')\n"
    "    assert(r.mask[i] == 0 or r.mask[i] == 1, 'mask value not 0/1')\n"
    "  end\n"
    "  local at = 1\n"
    "  for _, g in ipairs(r.segments) do\n"
    "    assert(g.first == at, 'segments do not tile the ids')\n"
    "    at = at + g.count\n"
    "  end\n"
    "  assert(at == #r.ids + 1, 'segments do not cover the ids')\n"
    "  assert(tok:decode(r.ids) == r.text, 'the ids do not decode to the text')\n"
    "end\n"
    "return tok\n";

DS4F_LUA_TARGET(CHUNK)

// Prints the GPT-2 token ids the npm package gpt-3-encoder gives each string of a JSON array,
// as a JSON array of arrays: the independent encoder the GPT-2 BPE test compares with.
// usage: node gpt2_encode.js PACKAGE_DIR STRINGS.json
'use strict';
const fs = require('fs');
const { encode } = require(process.argv[2]);
const strings = JSON.parse(fs.readFileSync(process.argv[3], 'utf8'));
process.stdout.write(JSON.stringify(strings.map((s) => encode(s))));

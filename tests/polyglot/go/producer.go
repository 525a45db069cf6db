// A delayed-message plugin user's producer, as written today with amqp091-go: publisher
// confirms, an x-delay header (ms), persistent messages. The one change for hopsched: no
// ExchangeDeclare(..., "x-delayed-message", ...) (hopsched declares the exchange; a
// broker without the plugin refuses that type).
//
// usage: producer AMQP_URL EXCHANGE ROUTING_KEY DELAY_MS...
// Delays alternate between the integer and the string form of x-delay. Each body is JSON:
// {"producer": "go", "index", "delay", "published_ms"}, published_ms taken just before
// the publish. Exits 0 once the broker confirmed every message.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

func fail(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "producer failed: "+format+"\n", args...)
	os.Exit(1)
}

func main() {
	if len(os.Args) < 5 {
		fmt.Fprintln(os.Stderr, "usage: producer AMQP_URL EXCHANGE ROUTING_KEY DELAY_MS...")
		os.Exit(2)
	}
	url, exchange, routingKey, delays := os.Args[1], os.Args[2], os.Args[3], os.Args[4:]
	connection, err := amqp.Dial(url)
	if err != nil {
		fail("connect: %v", err)
	}
	defer connection.Close()
	channel, err := connection.Channel()
	if err != nil {
		fail("channel: %v", err)
	}
	if err := channel.Confirm(false); err != nil {
		fail("confirm.select: %v", err)
	}
	// The confirm listener every amqp091 version expands multiple acks into: its
	// DeferredConfirmation of 1.5.0 left a CI run waiting for good on RabbitMQ 4.0.
	confirms := channel.NotifyPublish(make(chan amqp.Confirmation, len(delays)))
	for index, text := range delays {
		delay, err := strconv.Atoi(text)
		if err != nil {
			fail("delay %q: %v", text, err)
		}
		var xDelay interface{} = delay
		if index%2 == 1 {
			xDelay = strconv.Itoa(delay)
		}
		body, err := json.Marshal(map[string]interface{}{
			"producer":     "go",
			"index":        index,
			"delay":        delay,
			"published_ms": time.Now().UnixMilli(),
		})
		if err != nil {
			fail("body: %v", err)
		}
		err = channel.Publish(exchange, routingKey, false, false, amqp.Publishing{
			DeliveryMode:    amqp.Persistent,
			ContentType:     "application/json",
			ContentEncoding: "utf-8",
			MessageId:       fmt.Sprintf("%s-go-%d", exchange, index),
			CorrelationId:   fmt.Sprintf("go-%d", index),
			AppId:           "polyglot-go",
			Type:            "order.created",
			Headers:         amqp.Table{"x-delay": xDelay, "x-producer": "go"},
			Body:            body,
		})
		if err != nil {
			fail("publish: %v", err)
		}
	}
	deadline := time.After(20 * time.Second)
	for confirmed := 0; confirmed < len(delays); confirmed++ {
		select {
		case confirm, open := <-confirms:
			if !open {
				fail("the channel closed with %d of %d confirmed", confirmed, len(delays))
			}
			if !confirm.Ack {
				fail("delivery tag %d was nacked", confirm.DeliveryTag)
			}
		case <-deadline:
			fail("%d of %d confirmed after 20 s", confirmed, len(delays))
		}
	}
	if err := channel.Close(); err != nil {
		fail("close: %v", err)
	}
}
